#!/usr/bin/env bash
# The test command (README, CI). Every argument goes to pytest:
#   bash scripts/test.sh                  the whole suite (CI; before a stop)
#   bash scripts/test.sh --quick          no real vLLM engine: unit, fuzz and stub-engine
#                                         tests, under 3 minutes (the inner loop)
#   bash scripts/test.sh tests/unit/test_config.py -x    one module
# --quick and --run-wip are options of tests/conftest.py (which decides which
# tests start a real engine: the real_engine marker). wip tests stay
# deselected under any -m unless --run-wip or -m names wip.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
cd "$HERE"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$VENV/bin/python" -m pytest "$@"

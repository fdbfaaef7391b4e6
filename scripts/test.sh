#!/usr/bin/env bash
# The test command (README, CI). Every argument goes to pytest:
#   bash scripts/test.sh                  the whole suite (CI; before a stop)
#   bash scripts/test.sh --quick          no real vLLM engine: unit, fuzz and stub-engine
#                                         tests, under 3 minutes (the inner loop)
#   bash scripts/test.sh tests/unit/test_config.py -x    one module
#   bash scripts/test.sh -n 0 ...         in one process (for --pdb, -s, print debugging)
# Workers: two pytest-xdist workers by default (ASCENDSERVE_TEST_WORKERS sets the number, 1:
# one process), each taking whole modules (--dist loadscope; tests/conftest.py sends the
# heaviest first); an -n of your own, or -p no:xdist, replaces that (-n 0 for --pdb, -s).
# --quick and --run-wip are options
# of tests/conftest.py (which decides which tests start a real engine: the real_engine marker).
# wip tests stay deselected under any -m unless --run-wip or -m names wip.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
cd "$HERE"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
WORKERS=${ASCENDSERVE_TEST_WORKERS:-2}
XDIST=(-n "$WORKERS" --dist loadscope --no-loadscope-reorder)
for arg in "$@"; do
    case $arg in
        -n|-n[0-9]*|--numprocesses|--numprocesses=*|no:xdist|-pno:xdist|--pdb|--trace) XDIST=() ;;
    esac
done
[ "$WORKERS" -le 1 ] && XDIST=()
exec "$VENV/bin/python" -m pytest ${XDIST[@]+"${XDIST[@]}"} "$@"

#!/usr/bin/env bash
# The test command (README, CI): the whole suite with the installed venv.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${ASCENDSERVE_VENV:-$HOME/.venvs/ascendserve}
cd "$HERE"
exec "$VENV/bin/python" -m pytest "$@"

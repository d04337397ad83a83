#!/usr/bin/env bash
# The test command: installs what the tests need (scripts/install.sh test), lints, then runs
# pytest with Triton's interpreter so kernel tests run on CPU, on one worker process per core (at
# most 4; PENELOPE_TEST_WORKERS sets the number, 0 runs in this process). Extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
VENV=${PENELOPE_VENV:-.venv}
"$VENV/bin/ruff" check .
export TRITON_INTERPRET=1
cores=$(nproc)
workers=${PENELOPE_TEST_WORKERS:-$((cores < 4 ? cores : 4))}
# loadgroup: tests that share an expensive session fixture run on one worker (`xdist_group`).
exec "$VENV/bin/python" -m pytest -n "$workers" --dist loadgroup "$@"

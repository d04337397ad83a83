#!/usr/bin/env bash
# The main job on the built-in default: installs the package and runs the reproduction.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh base
VENV=${PENELOPE_VENV:-.venv}
exec "$VENV/bin/penelope" cost "$@"

#!/usr/bin/env bash
# The main job on the built-in defaults: installs the package into .venv, then runs
# `penelope reproduce` (cost curve + trace replays; JSON and plots in results/). Extra arguments
# go to `penelope reproduce` (see `penelope reproduce --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh base
VENV=${PENELOPE_VENV:-.venv}
exec "$VENV/bin/penelope" reproduce "$@"

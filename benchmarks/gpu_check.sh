#!/usr/bin/env bash
# GPU check: CUDA kernels vs the CPU path at LME-m scale (500 histories x 2000 nodes). Installs nothing;
# parts whose package (cupy, faiss GPU) is missing are skipped with a line saying so. Finishes < 5 min.
# Usage: bash benchmarks/gpu_check.sh [extra args for gpu_check.py, e.g. --histories 100]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 300 "$PY" benchmarks/gpu_check.py --device cuda "$@"

#!/usr/bin/env bash
# GPU node check: every GPU path (kernels, encoder, vLLM) against the CPU path in the same run, with agreement
# thresholds, throughput, and a markdown table for docs/benchmarks.md ("GPU node"). Each part runs in its own
# process. Installs nothing and fetches nothing (offline); <= 8 minutes on one H200 (hard limit below).
#
#   bash benchmarks/gpu_check.sh                  # after `make setup-gpu`; exit 0 only if every part PASSES
#   bash benchmarks/gpu_check.sh --allow-skip     # no CUDA device -> one loud SKIPPED line, exit 0
#   bash benchmarks/gpu_check.sh --parts env,ppr --table-out /tmp/gpu.md
# Without a CUDA device (and without --allow-skip) it prints one line and exits 2. See gpu_check.py --help.
# association.search=ivf has no GPU path (faiss-cpu only, issue 29): nothing of it is checked here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
timeout --kill-after=15 480 "$PY" benchmarks/gpu_check.py "$@"
rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "gpu_check: FAIL: stopped at the 8-minute limit (exit $rc)"
fi
exit $rc

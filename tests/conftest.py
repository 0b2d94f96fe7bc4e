"""Facts about the bundled sample, derived once from the raw file (plain json, not our loaders), so tests
compare the loaders' counts with an independent count instead of with numbers copied from a previous run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# OpenMP threads (torch's intra-op pool) that wait for work by sleeping, not spinning: the suite runs the
# models next to Ray workers and `memgas` subprocesses on 2 cores, where spinning threads take the cores
# the others need (SmolLM2 answering one question took 45-60 s instead of 11 s on a loaded 2-core machine).
# Set before anything imports torch; subprocesses and Ray workers (OMP_* is forwarded) inherit it. It
# changes scheduling only, never a result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No progress bars, as in the environment the `memgas` subprocesses get (tests/jobs/conftest.py): tqdm reads
# TQDM_* once, when it is imported, so `memgas` run in-process (cli.main) needs it set before that.
os.environ.setdefault("TQDM_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]
# What memgas derives from model files (de-quantised GGUF weights, ONNX exports) goes to one cache for the
# suite's processes, Ray workers and subprocesses: the first SmolLM2 load converts the GGUF (~20 s), every
# later one reads the verified copy. Inside the checkout (ignored by git), so a fresh clone starts cold and
# the suite never writes into the user's ~/.cache. tests/pipeline/models/test_gguf_cache.py tests the
# conversion itself in a cache of its own.
os.environ.setdefault("MEMGAS_CACHE_DIR", str(REPO / ".pytest_cache" / "memgas"))
SAMPLE_LOCOMO = REPO / "data" / "sample" / "locomo_sample.json"


def _locomo_counts(path: Path) -> dict[str, int]:
    data = json.loads(path.read_text())
    sessions = sum(1 for conv in data for key, turns in conv["conversation"].items()
                   if re.fullmatch(r"session_\d+", key) and turns)
    return {"histories": len(data), "sessions": sessions, "queries": sum(len(conv["qa"]) for conv in data)}


#: {"histories": 2, "sessions": 38, "queries": 304} for the bundled two-conversation LoCoMo sample
SAMPLE_COUNTS: dict[str, int] = _locomo_counts(SAMPLE_LOCOMO)


#: Test files in the order the two `make test` workers should start them: longest first (their wall time on
#: 2 cores, measured with `--durations=0`), then every other file in collection order. pytest-xdist's
#: `--dist loadfile` hands each worker whole files in queue order; with the longest last (its default
#: orders files by their number of tests, which put the few-but-slow Ray and kill tests at the end), one
#: worker idled for minutes while the other finished it. `make test` passes `--no-loadscope-reorder` so the
#: queue keeps this order. Order only: every test still runs, in its file's own order. tests/test_gpu_stack.py
#: is not listed: collected last, its resolver test then finds pip's background resolution (below) finished.
LONGEST_FIRST = (
    "tests/jobs/test_ray_cluster.py",
    "tests/benchmarks/test_bench_models.py",
    "tests/benchmarks/test_bench_job.py",
    "tests/jobs/test_resume.py",
    # before the first file that loads SmolLM2: its fixture fills the suite's model cache (see that file)
    "tests/pipeline/models/test_gguf_cache.py",
    "tests/jobs/test_stages.py",
    "tests/jobs/test_justmem_stages.py",
    "tests/pipeline/models/test_encoders.py",
    "tests/jobs/test_exit_codes.py",
    "tests/jobs/test_runner_faults.py",
    "tests/jobs/test_append_index.py",
    "tests/pipeline/test_ingest.py",
    "tests/pipeline/test_generate.py",
)


def pytest_collection_modifyitems(session: object, config: object, items: list) -> None:
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::")[0], len(rank)), order[id(item)]))


# -- pip's resolution of the gpu extra, started in the background at the suite's start --------------------------
# tests/test_gpu_stack.py's resolver test waits on the package index for minutes with almost no CPU. Started
# here, in the process that hands out the files (xdist's controller, or the only process), it runs while the
# other tests do, and the test only reads its result: no worker waits on the network. Only when the run
# would select that test (a whole-suite or that file's run, without -k or a marker that drops slow tests).
GPU_STACK_TEST = REPO / "tests" / "test_gpu_stack.py"
GPU_EXTRA_PREFETCH_ENV = "MEMGAS_TEST_GPU_EXTRA_PREFETCH"  # as test_gpu_stack.PREFETCH_ENV


def _selects_gpu_extra_test(config: object) -> bool:
    opt = config.option  # type: ignore[attr-defined]
    if getattr(opt, "keyword", "") or "slow" in (getattr(opt, "markexpr", "") or ""):
        return False
    here = Path(config.invocation_params.dir)  # type: ignore[attr-defined]
    for arg in config.args or [str(REPO / "tests")]:  # type: ignore[attr-defined]
        path = (here / arg.split("::")[0]).resolve()
        if path == GPU_STACK_TEST or path in GPU_STACK_TEST.parents:
            return "::" not in arg or arg.split("::")[1].startswith("test_gpu_extra")
    return False


def pytest_configure(config: object) -> None:
    if hasattr(config, "workerinput") or os.environ.get(GPU_EXTRA_PREFETCH_ENV) or not _selects_gpu_extra_test(config):
        return
    out = Path(tempfile.mkdtemp(prefix="memgas-gpu-extra-"))
    proc = subprocess.Popen([sys.executable, str(GPU_STACK_TEST), str(out)], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    (out / "started").write_text(str(proc.pid))
    os.environ[GPU_EXTRA_PREFETCH_ENV] = str(out)  # xdist's workers start later, with this environment
    config._memgas_gpu_extra = (proc, out)  # type: ignore[attr-defined]


def pytest_unconfigure(config: object) -> None:
    started = getattr(config, "_memgas_gpu_extra", None)
    if started is None:
        return
    proc, out = started
    if proc.poll() is None:  # the run ended (or was interrupted) first: pip and its children go too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    os.environ.pop(GPU_EXTRA_PREFETCH_ENV, None)
    shutil.rmtree(out, ignore_errors=True)

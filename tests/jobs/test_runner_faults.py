"""The job runner under hostile use: --fresh on a directory that is not a run, an unreachable cluster, two
runs on one output directory (a model actor killed mid-unit: tests/jobs/test_resume.py). Real Ray; `memgas`
in-process through ``cli.main`` (tests/jobs/conftest.py) where one process is enough, real processes for the
lock race."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import run_memgas

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).with_name("memgas"))
#: the smallest file on which every stage does real work (tests/fixtures/make_locomo_small.py)
SMALL = ["--set", "data.path=tests/fixtures/locomo_small.json", "--set", "data.limit=1", "--set", "reading.enabled=false", "--set", "retrieval.methods=[session,memgas]", "--set", "evaluation.plots=false"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _in_process(*args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    return run_memgas(*args, timeout=timeout, check=False, env=env)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln and " WARNING " not in ln]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_fresh_refuses_a_directory_that_is_not_a_run(tmp_path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    proc = _in_process("run", "configs/demo.yaml", "--set", f"output_dir={out}", "--fresh", *SMALL)
    assert proc.returncode == 2 and "refusing to delete" in _one_line_error(proc)
    assert (out / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("value", ["", "."])
def test_output_dir_empty_or_cwd_is_refused(value) -> None:
    before = sorted(p.name for p in REPO.iterdir())
    proc = _in_process("run", "configs/demo.yaml", "--set", f"output_dir={value}", "--fresh", *SMALL)
    assert proc.returncode == 2 and "output_dir" in _one_line_error(proc)
    assert sorted(p.name for p in REPO.iterdir()) == before


def test_unreachable_cluster_fails_fast_with_exit_3(tmp_path) -> None:
    t0 = time.time()
    proc = _in_process("run", "configs/demo.yaml", "--set", f"output_dir={tmp_path / 'r'}", "--address",
                   "127.0.0.1:1", *SMALL, timeout=120)
    assert proc.returncode == 3 and "cannot connect" in _one_line_error(proc)
    assert time.time() - t0 < 60


@pytest.mark.slow
def test_second_run_on_a_locked_output_dir_is_refused(tmp_path) -> None:
    out = tmp_path / "busy"
    first = subprocess.Popen([EXE, "run", "configs/demo.yaml", "--set", f"output_dir={out}", "--no-ray", *SMALL],
                             cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "RUNNING.json").exists():
            time.sleep(0.2)
        assert (out / "RUNNING.json").exists(), "the first run never started"
        second = _in_process("run", "configs/demo.yaml", "--set", f"output_dir={out}", "--no-ray", *SMALL, timeout=120)
        line = _one_line_error(second)
        assert second.returncode == 2 and "in use by pid" in line and str(first.pid) in line
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)


@pytest.mark.slow
# A model actor killed mid-unit (replaced, its unit re-run, the bytes unchanged): tests/jobs/test_resume.py,
# test_ray_path_matches_in_process_path_even_after_a_killed_actor (one Ray run shows both).


def test_unreachable_generation_server_stops_after_generate_with_one_line(tmp_path) -> None:
    """generator=llm against a server that does not answer: no "generations missing" downstream, one line
    naming the backend error; the failed sessions are retried by the next run (nothing is marked done)."""
    out = tmp_path / "run"
    proc = _in_process("run", "configs/demo.yaml", "--set", f"output_dir={out}", *SMALL, "--set", "generation.generator=llm",
                   "--set", "llm.backend=openai", "--set", "llm.base_url=http://127.0.0.1:1/v1", "--set",
                   "llm.max_retries=0", "--set", "llm.timeout_s=2", "--no-ray", timeout=600)
    line = _one_line_error(proc)
    assert proc.returncode == 2 and "generate:" in line and "failed in the LLM backend" in line, line
    assert not (out / "bank" / "_stages" / "generate.json").exists()
    assert json.loads((out / "RUNNING.json").read_text())["status"] == "failed"

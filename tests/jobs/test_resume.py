"""A real job killed with SIGKILL resumes and ends with byte-identical tables, no lost or duplicated rows.

The reference is an uninterrupted run; the killed run is interrupted twice (during generation and during
encoding) and then completed. The Ray path must produce the same bytes as the in-process path. Then a
job is killed at named points (the fault hook, not timing) of every stage, the runner's marker write and
compaction, one after the other, and still ends byte-identical.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.schema import KEYS

pytestmark = pytest.mark.slow

# 8 sessions of one LoCoMo conversation (tests/fixtures/locomo_small.json: every stage does real work),
# LLM-free generator, units of one session and ~24 texts: 8 generate and 6 encode units, so a kill by
# polling the markers lands with units left to resume (what is resumed is the same on a larger file)
SETTINGS = [
    "--set", "data.path=tests/fixtures/locomo_small.json", "--set", "data.limit=1", "--set", "reading.enabled=false",
    "--set", "ray.generate_unit=1", "--set", "ray.encode_unit=24",
    "--set", "retrieval.methods=[session,turn,memgas,memgas-no-gmm]", "--set", "evaluation.plots=false",
]


def _args(out: Path, *extra: str) -> list[str]:
    return ["run", "configs/demo.yaml", "--set", f"output_dir={out}", *SETTINGS, *extra]


def _tables(run_dir: Path) -> dict[str, bytes]:
    """Every Parquet part of the bank and the results, by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.glob("*/*/*.parquet"))}


def _markers(path: Path) -> int:
    return len(list(path.glob("_done/*.json"))) if path.exists() else 0


def _run_and_kill(exe, out: Path, table: str, min_parts: int, timeout: float = 300) -> int:
    """Start a real `memgas run`, SIGKILL its process group once ``table`` has ``min_parts`` new parts."""
    path, env, repo = exe
    start = _markers(out / "bank" / table)
    proc = subprocess.Popen([path, *_args(out, "--no-ray")], cwd=repo, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            if _markers(out / "bank" / table) >= start + min_parts:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cli) -> Path:
    out = tmp_path_factory.mktemp("reference")
    cli(*_args(out, "--no-ray"))
    return out


def test_kill9_twice_then_resume_is_byte_identical(tmp_path, cli, memgas_exe, reference) -> None:
    out = tmp_path / "killed"
    rc1 = _run_and_kill(memgas_exe, out, "generations", 2)
    assert rc1 == -signal.SIGKILL, "the job finished before it could be killed during generation"
    rc2 = _run_and_kill(memgas_exe, out, "embeddings", 2)
    assert rc2 == -signal.SIGKILL, "the job finished before it could be killed during encoding"
    # the interrupted bank holds partial work, and the plans that fix its units
    assert list((out / "bank" / "_plans").glob("*.json"))
    cli(*_args(out, "--no-ray"))

    got, want = _tables(out), _tables(reference)
    assert sorted(got) == sorted(want)
    differing = [k for k in want if got[k] != want[k]]
    assert not differing, f"tables differ after resume: {differing}"
    assert not list((out / "bank" / "_plans").glob("*.json")), "plans must be removed when stages finish"

    # no lost or duplicated rows: every key once, and row counts as in the reference
    for root in ("bank", "results"):
        bank, ref = Bank(out / root), Bank(reference / root)
        for name in bank.tables():
            t = bank.read(name, dedupe=False)
            assert t.num_rows == ref.read(name, dedupe=False).num_rows, name
            keys = t.select(list(KEYS[name])).to_pylist()
            assert len({tuple(k.values()) for k in keys}) == len(keys), f"duplicate keys in {name}"


def test_resume_and_fresh_runs_with_other_batch_and_unit_sizes_are_byte_identical(tmp_path, cli, memgas_exe,
                                                                                 reference) -> None:
    """Batch and unit sizes are runtime-only: a run killed in encode and resumed with other
    ``encoder.batch_size`` / ``ray.encode_unit`` / ``ray.generate_unit``, and a fresh run with them, store the
    same bytes as the reference (every vector is a function of its text and the encoder alone)."""
    sizes = ["--set", "encoder.batch_size=3", "--set", "ray.encode_unit=20", "--set", "ray.generate_unit=3"]
    out = tmp_path / "resized"
    rc = _run_and_kill(memgas_exe, out, "embeddings", 2)
    assert rc == -signal.SIGKILL, "the job finished before it could be killed during encoding"
    (out / "bank" / "_plans").exists() and [p.unlink() for p in (out / "bank" / "_plans").glob("*.json")]
    cli(*_args(out, "--no-ray", *sizes))  # new units for what is left, other batches
    fresh = tmp_path / "fresh"
    cli(*_args(fresh, "--no-ray", *sizes))
    want = _tables(reference)
    for got in (_tables(out), _tables(fresh)):
        assert sorted(got) == sorted(want)
        assert [k for k in want if got[k] != want[k]] == []


def test_rerun_skips_everything(tmp_path, cli, reference) -> None:
    """A second run over a finished bank computes nothing new and leaves the tables unchanged."""
    before = _tables(reference)
    proc = cli("-v", *_args(reference, "--no-ray"))
    log = proc.stderr
    assert "skipping ingest" in log
    assert _tables(reference) == before


def test_ray_path_matches_in_process_path_even_after_a_killed_actor(tmp_path, cli, reference) -> None:
    """A local embedded Ray (model actors, sharded tasks) writes the in-process run's bytes, even when the
    encoder actor is SIGKILLed in its first call (as Ray's OOM killer would): its unit runs again on a fresh
    actor, the run record counts the retry, and nothing of the killed call reaches a table."""
    out, state = tmp_path / "ray", tmp_path / "faults"
    state.mkdir()
    cli(*_args(out), env={"MEMGAS_FAULT": "kill-once@actor-call:SentenceTransformerEncoder",
                          "MEMGAS_FAULT_STATE": str(state)})
    assert list(state.iterdir()), "the fault was never injected"
    record = {r["stage"]: r for r in json.loads((out / "run_record.json").read_text())}
    assert record["encode"]["actor_retries"] == 1 and record["encode"]["status"] == "executed"
    got, want = _tables(out), _tables(reference)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
    assert Bank(out / "results").count("rankings") > 0


#: (fault spec) for one kill each, in pipeline order: after a unit of every unit stage, inside compaction,
#: and between a stage's last unit and its completion marker.
KILL_POINTS = [
    "kill@generate:unit-done#2",
    "kill@bank:compact:after-new",
    "kill@encode:unit-done#1",
    "kill@runner:before-marker:encode",
    "kill@associate:unit-done#1",
    "kill@rank:unit-done#1",
    "kill@runner:before-marker:rank",
]


def test_kill_at_named_points_of_every_stage_then_resume(tmp_path, cli, memgas_exe, reference) -> None:
    path, env, repo = memgas_exe
    out = tmp_path / "points"
    killed = []
    for spec in KILL_POINTS:
        proc = subprocess.run([path, *_args(out, "--no-ray")], cwd=repo, env={**env, "MEMGAS_FAULT": spec},
                              capture_output=True, text=True, timeout=600)
        killed.append((spec, proc.returncode))
    assert all(rc == -signal.SIGKILL for _, rc in killed), killed
    cli(*_args(out, "--no-ray"))
    got, want = _tables(out), _tables(reference)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []

"""``association.search: ivf`` through the associate stage (issue 29).

Through the CLI (in-process, real LLM-free generator and MiniLM encoder, no Ray): an index after an append
over the saved IVF index equals a fresh IVF build byte for byte (edges, recall rows and the saved index);
a damaged saved index is rebuilt, never searched; the recall the stage measured is in metrics.json and
report.md. Through the stage's task with designed vectors: the recall of rows whose exact neighbours are
known. A real `memgas index` process killed inside an IVF build resumes to the bytes of an uninterrupted one.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memgas.pipeline.bank import Bank

from .test_append_index import _file

REPO = Path(__file__).resolve().parents[2]

# h0: 30 sessions (120 nodes), h1: 26; the first 80 nodes (20 sessions) exact, 2 lists (80 // 39), 1 probed
IVF = ["--set", "association.search=ivf", "--set", "association.ivf_exact_nodes=80", "--set",
       "association.ivf_nlist=2", "--set", "association.ivf_nprobe=1"]
CONFIG = ["--config", str(REPO / "configs" / "demo.yaml"), "--no-ray", "--set", "retrieval.methods=[session,memgas]",
          "--set", "reading.enabled=false", "--set", "evaluation.ks=[1,3,5]", "--set", "ray.shard_size=1", "--set", "evaluation.plots=false", *IVF]
#: sessions per block of the IVF grid in the append tests: A ends inside a block (22 = 2 x 8 + 6), so the
#: append's first rows share a block with A's last sessions, which the saved index does not hold
GRID = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("ivf_data")
    a = _file(d / "a.jsonl", {0: range(0, 22), 1: range(0, 26)}, {0: [3, 21], 1: [25]})
    b = _file(d / "b.jsonl", {0: range(22, 30)}, {0: [27]})
    return a, b


def _edges(bank: Path) -> list[tuple]:
    t = Bank(bank).read("edges")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "mode", "src", "dst", "similarity"))))


def _rows(bank: Path, table: str) -> list[tuple]:
    t = Bank(bank).read(table)
    return sorted(zip(*(t[c].to_pylist() for c in t.column_names)))


def _associate_stats(bank: Path) -> dict[str, Any]:
    return Bank(bank).manifest["index"]["stages"]["associate"]["extra"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, files: tuple[Path, Path], cli: Callable) -> dict[str, Any]:
    """``grown``: A indexed, B appended, indexed again (over the saved index); ``fresh``: A + B indexed once;
    ``appended``: a copy of ``grown`` after the append, before its second index (for the damage test).
    ``fresh`` starts with ``grown``'s embeddings (content-addressed: the encoder does not run again; its
    association starts from nothing)."""
    from memgas.pipeline.association import ivf_search

    a, b = files
    d = tmp_path_factory.mktemp("ivf_built")
    out: dict[str, Any] = {k: d / k for k in ("grown", "fresh", "appended", "run")}
    mp = pytest.MonkeyPatch()
    mp.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    try:
        cli("ingest", str(a), "--format", "jsonl", "--out", str(out["grown"]))
        cli("index", str(out["grown"]), *CONFIG)
        out["index_before"] = _rows(out["grown"], "ivf_index")
        cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(out["grown"]))
        shutil.copytree(out["grown"], out["appended"])
        cli("index", str(out["grown"]), *CONFIG)
        out["stats_grown"] = _associate_stats(out["grown"])
        cli("ingest", str(a), "--format", "jsonl", "--out", str(out["fresh"]))
        cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(out["fresh"]))
        shutil.copytree(out["grown"] / "embeddings", out["fresh"] / "embeddings")
        cli("index", str(out["fresh"]), *CONFIG)
        cli("answer", str(out["fresh"]), *CONFIG, "--out", str(out["run"]))
    finally:
        mp.undo()
    return out


@pytest.mark.slow
def test_ivf_index_after_append_equals_a_fresh_build_byte_for_byte(built: dict[str, Any]) -> None:
    grown, fresh = built["grown"], built["fresh"]
    # after A: each history's index holds its complete grid blocks (h0: 16 of 22 sessions, h1: 24 of 26)
    assert [(h, end, s) for h, end, s, *_ in built["index_before"]] == [("h0", 22, 16), ("h1", 26, 24)]
    assert built["stats_grown"]["ivf_index_reused"] == 1 and built["stats_grown"]["ivf_index_rebuilt"] == 0
    assert _edges(grown) == _edges(fresh)
    assert len([e for e in _edges(grown) if e[0] == "h0" and e[2] >= 4 * 22]) > 0, "the append made no edges"
    # the saved index (its bytes too) and the recall rows: those of one build over A + B
    idx = _rows(grown, "ivf_index")
    assert [(h, end, s) for h, end, s, *_ in idx] == [("h0", 30, 24), ("h1", 26, 24)]
    assert idx == _rows(fresh, "ivf_index")
    assert len(Bank(grown).parts("ivf_index")) == 2, "the superseded index of h0 was kept"
    recall = {(h, a, b): (n, x, t) for h, a, b, n, x, t in _rows(grown, "ivf_recall")}
    assert set(recall) == {("h0", 0, 22), ("h0", 22, 30), ("h1", 0, 26)}
    # fresh: one segment of h0, whose rows (past the 80 exact nodes) are all sampled
    fresh_recall = {(h, a, b): (n, x, t) for h, a, b, n, x, t in _rows(fresh, "ivf_recall")}
    assert fresh_recall[("h0", 0, 30)][0] == 4 * 30 - 80
    assert recall[("h0", 0, 22)][0] + recall[("h0", 22, 30)][0] == 4 * 30 - 80
    hits = sum(x for _, x, _ in recall.values())
    assert hits < sum(t for *_, t in recall.values()), "1 of 2 lists probed but every exact candidate found"


@pytest.mark.slow
def test_the_recall_is_in_metrics_and_report(built: dict[str, Any]) -> None:
    metrics = json.loads((built["run"] / "metrics.json").read_text())
    a = metrics["run"]["association"]
    rows = _rows(built["fresh"], "ivf_recall")
    hits, total = sum(r[4] for r in rows), sum(r[5] for r in rows)
    assert a["search"] == "ivf" and a["ivf_nlist"] == 2 and a["ivf_nprobe"] == 1 and a["ivf_exact_nodes"] == 80
    assert a["ivf_recall"] == hits / total and a["ivf_recall_k"] == 30
    assert a["ivf_recall_rows"] == (4 * 30 - 80) + (4 * 26 - 80) and a["ivf_recall_histories"] == 2
    report = (built["run"] / "report.md").read_text()
    assert f"candidate recall@30 against the exact search {hits / total:.4f} on 64 sampled rows of 2 histories" \
        in report, report[:1500]


@pytest.mark.slow
def test_a_damaged_saved_index_is_rebuilt_never_searched(tmp_path: Path, built: dict[str, Any], cli: Callable,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from memgas.pipeline.association import ivf_search

    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    bank = tmp_path / "bank"
    shutil.copytree(built["appended"], bank)
    part = next(p for p in Bank(bank).parts("ivf_index") if "h0" in Bank(bank).read("ivf_index", parts=[p])["history_id"].to_pylist())
    f = bank / "ivf_index" / f"{part}.parquet"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one byte inside the index blob: still a Parquet file
    f.write_bytes(bytes(raw))
    p = cli("index", str(bank), *CONFIG)
    assert "saved IVF index of history h0" in p.stderr and "damaged; rebuilding it" in p.stderr, p.stderr[-2000:]
    stats = _associate_stats(bank)
    assert stats["ivf_index_rebuilt"] == 1 and stats["ivf_index_reused"] == 0
    assert _edges(bank) == _edges(built["fresh"])
    assert _rows(bank, "ivf_index") == _rows(built["fresh"], "ivf_index")


@pytest.mark.slow
def test_kill_inside_an_ivf_build_then_resume_is_byte_identical(tmp_path: Path, built: dict[str, Any], cli: Callable,
                                                                 memgas_exe: tuple) -> None:
    """Another nprobe (a new key, so every IVF unit runs again on the encoded bank), default grid: a real
    process killed after its first unit's parts, then resumed, ends with an uninterrupted build's bytes."""
    path, env, repo = memgas_exe
    cfg = [*CONFIG, "--set", "association.ivf_nprobe=2"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    shutil.copytree(built["fresh"], ref)
    shutil.copytree(built["fresh"], killed)
    cli("index", str(ref), *cfg)
    proc = subprocess.run([path, "index", str(killed), *cfg], cwd=repo, capture_output=True, text=True, timeout=600,
                          env={**env, "MEMGAS_FAULT": "kill@associate:unit-done#1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    new = set(Bank(ref).parts("ivf_index"))
    assert new & set(Bank(killed).parts("ivf_index")), "no IVF unit was done before the kill"
    assert new - set(Bank(killed).parts("ivf_index")), "every IVF unit was done before the kill"
    cli("index", str(killed), *cfg)
    for table in ("edges", "edge_segments", "ivf_index", "ivf_recall"):
        got = {p: (killed / table / f"{p}.parquet").read_bytes() for p in Bank(killed).parts(table)}
        want = {p: (ref / table / f"{p}.parquet").read_bytes() for p in Bank(ref).parts(table)}
        assert got == want, table


def _designed_history(n_sessions: int = 64, dim: int = 16) -> np.ndarray:
    """Sessions 8j+7 near axis 1, every other session near axis 0 (orthogonal): a row's exact neighbours
    are the nodes of its own axis first. A rare row (session 8j+7) has 4j earlier nodes on its axis, so
    for j < 8 its exact 30 hold those 4j and 30 - 4j of the other axis, while IVF with one of two lists
    probed finds only its own list's 4j."""
    rng = np.random.default_rng(5)
    axis = np.array([1 if s % 8 == 7 else 0 for s in range(n_sessions) for _ in range(4)])
    E = 0.02 * rng.normal(size=(4 * n_sessions, dim))
    E[np.arange(E.shape[0]), axis] += 1.0
    return (E / np.linalg.norm(E, axis=1, keepdims=True)).astype(np.float32)


def test_recall_of_rows_whose_exact_neighbours_are_known() -> None:
    """The associate stage's task on the designed history: the recall row it writes is the one computed
    by hand (exact prefix 80 nodes, all 176 IVF rows sampled)."""
    from memgas.jobs.stages.associate import AssociateStage
    from memgas.pipeline.config import AssociationConfig

    E = _designed_history()
    a = AssociationConfig(search="ivf", ivf_nlist=2, ivf_nprobe=1, ivf_exact_nodes=80).model_dump()
    out = AssociateStage.run(None, {"segments": [["h", 0, 64, "d64"]], "matrices": [E],
                                    "indexes": [{"saved": None, "digest": "d0"}]},
                             {"association": a, "device": "cpu"})
    rec = out["ivf_recall"].to_pylist()
    rare = [j for j in range(8) if 8 * j + 7 >= 20]  # rare sessions past the exact prefix (session 20 on)
    missed = sum(4 * (30 - 4 * j) for j in rare)  # 4 rows each, 30 - 4j exact candidates out of reach
    assert rec == [{"history_id": "h", "first_session": 0, "end_session": 64, "rows": 176,
                    "hits": 176 * 30 - missed, "total": 176 * 30}]
    idx = out["ivf_index"].to_pylist()
    assert [(r["history_id"], r["end_session"], r["sessions"], r["prefix_digest"]) for r in idx] == [("h", 64, 0, "d0")]


#: the associate stage alone (through the runner) on the seeded bank at argv[1] under the IVF of argv[2], with
#: the constants of test_node_blocks' cut tests: 4 units of one 360-session history, blocks of 16 sessions
_ASSOCIATE_SCRIPT = """
import json, sys
from memgas.jobs import runner
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import StageContext
from memgas.pipeline.association import blocks, ivf_search, segments
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
blocks.BLOCK_ROWS, segments.IVF_UNIT_SESSIONS, ivf_search.STAGE_BLOCK_SESSIONS = 64, 96, 16
cfg = MemgasConfig(association={**MemgasConfig().association.model_dump(), **json.loads(sys.argv[2])})
ctx = StageContext(cfg, Bank(sys.argv[1]), None, use_ray=False)
fps = runner.compute_fingerprints(ctx)
stage = next(s for s in ctx.pipeline if s.name == "associate")
runner.run_stage(stage, ctx, stage.active(ctx), ctx.bank, fps["associate"], Profiler(), {})
"""


@pytest.mark.slow  # three processes on a 360-session seeded bank: ~15 s on 2 cores
def test_kill_between_the_ivf_units_of_one_history_then_resume_is_byte_identical(
        tmp_path: Path, memgas_exe: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """One history cut into 4 units (the first exact only): a real process killed after its second unit's
    parts, then resumed. The third unit starts past the exact prefix with no saved index (only the last
    unit saves one): it trains the centroids and adds the nodes before its rows itself. Every part's bytes
    are those of an uninterrupted build of the same plan."""
    import sys

    from memgas.pipeline.association import ivf_search

    from .test_node_blocks import (
        ASSOCIATE_TABLES,
        GRID,
        IVF_SMALL,
        associate_ctx,
        run_associate,
        seeded_bank,
        small_units,
    )

    _, env, repo = memgas_exe
    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    small_units(monkeypatch)
    ref, _ = seeded_bank(tmp_path / "ref", {"h": 360})
    units, _ = run_associate(associate_ctx(ref, IVF_SMALL))
    assert [s[1:3] for u in units for s in u["segments"]] == [[0, 96], [96, 192], [192, 288], [288, 360]]
    killed, _ = seeded_bank(tmp_path / "killed", {"h": 360})
    cmd = [sys.executable, "-c", _ASSOCIATE_SCRIPT, str(killed.path), json.dumps(IVF_SMALL)]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**env, "MEMGAS_FAULT": "kill@associate:unit-done#2"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert len(Bank(killed.path).parts("edge_segments")) == 2 and not Bank(killed.path).parts("ivf_index")
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for table in ASSOCIATE_TABLES:
        got = {p: (killed.path / table / f"{p}.parquet").read_bytes() for p in Bank(killed.path).parts(table)}
        want = {p: (ref.path / table / f"{p}.parquet").read_bytes() for p in Bank(ref.path).parts(table)}
        assert got == want and got, table


@pytest.mark.slow
def test_ivf_histories_cut_into_units_through_the_cli_equal_one_unit(tmp_path: Path, built: dict[str, Any],
                                                                     cli: Callable,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Real MiniLM vectors through `memgas index`: the fresh bank's association dropped, then rebuilt with each
    history cut at every 8 sessions (h0: 4 units, h1: 4) and node blocks of 2 sessions. Edges and saved indexes
    are those of one unit per history, byte for byte."""
    from memgas.pipeline.association import blocks, ivf_search, segments

    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    monkeypatch.setattr(segments, "IVF_UNIT_SESSIONS", 8)
    monkeypatch.setattr(blocks, "BLOCK_ROWS", 8)
    bank = tmp_path / "bank"
    shutil.copytree(built["fresh"], bank)
    b = Bank(bank)
    for table in ("edges", "edge_segments", "ivf_index", "ivf_recall"):
        for part in b.parts(table):
            b.drop_part(table, part)
    cli("index", str(bank), *CONFIG)
    segs = sorted(s[:3] for s in _rows(bank, "edge_segments"))
    assert segs == [("h0", a, min(a + 8, 30)) for a in range(0, 30, 8)] + [("h1", a, min(a + 8, 26))
                                                                          for a in range(0, 26, 8)]
    assert _edges(bank) == _edges(built["fresh"])
    assert _rows(bank, "ivf_index") == _rows(built["fresh"], "ivf_index")

"""``association.search: ivf`` through the associate stage.

Through the CLI (in-process, real LLM-free generator and MiniLM encoder, no Ray): an index after an append
over the saved IVF index equals a fresh IVF build byte for byte (edges and the saved index), and so does the
recall it reports (metrics.json, report.md: each history's bottom-k row keys, whatever the cut); a damaged
saved index is rebuilt, never searched. Through the stage's task with designed vectors: the recall of rows whose exact neighbours are
known. A real `memgas index` process killed inside an IVF build resumes to the bytes of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
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
#: rows per history in the recall sample of these tests: fewer than h0's 40 IVF rows and h1's 24, so that
#: which rows the bottom-k keeps matters (the default, 256, would sample every row)
RECALL_K = 16


def small_ivf(mp: pytest.MonkeyPatch) -> None:
    """The IVF grid and recall sample of these tests (the driver ships both to the stage's tasks)."""
    from memgas.pipeline.association import ivf_search

    mp.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    mp.setattr(ivf_search, "RECALL_ROWS", RECALL_K)


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
    association starts from nothing). ``run`` / ``run_grown``: answers over ``fresh`` / ``grown``."""
    a, b = files
    d = tmp_path_factory.mktemp("ivf_built")
    out: dict[str, Any] = {k: d / k for k in ("grown", "fresh", "appended", "run", "run_grown")}
    mp = pytest.MonkeyPatch()
    small_ivf(mp)
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
        out["stats_fresh"] = _associate_stats(out["fresh"])
        cli("answer", str(out["fresh"]), *CONFIG, "--out", str(out["run"]))
        cli("answer", str(out["grown"]), *CONFIG, "--out", str(out["run_grown"]))
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
    # the recall rows: each segment's IVF rows (past the 80 exact nodes) of its 16 smallest keys, so the
    # grown bank holds more of h0's rows (8 of A's segment, 16 of B's) than the fresh one (16 of its 40)
    recall = _rows(grown, "ivf_recall")
    per_segment = {}
    for h, a, b, *_ in recall:
        per_segment[(h, a, b)] = per_segment.get((h, a, b), 0) + 1
    assert per_segment == {("h0", 0, 22): 4 * 22 - 80, ("h0", 22, 30): RECALL_K, ("h1", 0, 26): RECALL_K}
    fresh_recall = _rows(fresh, "ivf_recall")
    assert [(h, a, b) for h, a, b, *_ in fresh_recall] == [("h0", 0, 30)] * RECALL_K + [("h1", 0, 26)] * RECALL_K
    # the fresh sample is the grown one's bottom-k per history: the same rows, keys and counts
    assert set(r[:1] + r[3:] for r in fresh_recall) <= set(r[:1] + r[3:] for r in recall)
    assert sum(r[5] for r in recall) < sum(r[6] for r in recall), "1 of 2 lists probed but every exact candidate found"


@pytest.mark.slow
def test_the_recall_is_in_metrics_and_report(built: dict[str, Any]) -> None:
    """The fresh bank's recall (one segment per history: its rows are the sample), and the grown bank's
    (A, then B over the saved index: other segments, more stored rows) is the same, bit for bit."""
    metrics = json.loads((built["run"] / "metrics.json").read_text())
    a = metrics["run"]["association"]
    rows = _rows(built["fresh"], "ivf_recall")
    hits, total = sum(r[5] for r in rows), sum(r[6] for r in rows)
    per = {h: sum(r[5] for r in rows if r[0] == h) / sum(r[6] for r in rows if r[0] == h) for h in ("h0", "h1")}
    assert a["search"] == "ivf" and a["ivf_nlist"] == 2 and a["ivf_nprobe"] == 1 and a["ivf_exact_nodes"] == 80
    assert a["ivf_recall"] == hits / total and a["ivf_recall_k"] == 30
    assert a["ivf_recall_rows"] == 2 * RECALL_K and a["ivf_recall_histories"] == 2
    assert a["ivf_recall_min_history"] == min(per.values())
    report = (built["run"] / "report.md").read_text()
    assert f"candidate recall@30 against the exact search {hits / total:.4f} on 32 sampled rows of 2 histories" \
        in report, report[:1500]
    grown = json.loads((built["run_grown"] / "metrics.json").read_text())["run"]["association"]
    assert grown == a
    recall = {k: v for k, v in built["stats_grown"].items() if k.startswith("ivf_recall")}
    assert recall == {k: v for k, v in built["stats_fresh"].items() if k.startswith("ivf_recall")} and recall


@pytest.mark.slow
def test_a_damaged_saved_index_is_rebuilt_never_searched(tmp_path: Path, built: dict[str, Any], cli: Callable,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    small_ivf(monkeypatch)
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
@pytest.mark.parametrize("damage", ["truncated", "FIFO", "symlink to /dev/zero"])
def test_a_saved_index_that_cannot_be_read_is_rebuilt(tmp_path: Path, built: dict[str, Any], cli: Callable,
                                                      monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """A saved index part that cannot be read (cut short, a FIFO or a symlink to /dev/zero in its place) made
    `index` after an append work on, then stop with exit 2 "delete it and re-run". It is damaged like a
    flipped byte: passed by unopened, rebuilt, and the index equals a fresh build's."""
    small_ivf(monkeypatch)
    bank = tmp_path / "bank"
    shutil.copytree(built["appended"], bank)
    part = next(p for p in Bank(bank).parts("ivf_index") if "h0" in Bank(bank).read("ivf_index", parts=[p])["history_id"].to_pylist())
    f = bank / "ivf_index" / f"{part}.parquet"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        f.unlink()
        os.mkfifo(f) if damage == "FIFO" else os.symlink("/dev/zero", f)
    cli("index", str(bank), *CONFIG)
    stats = _associate_stats(bank)
    assert (stats["ivf_index_rebuilt"], stats["ivf_index_reused"]) == (0, 0)  # never a candidate: not there
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
    from memgas.pipeline.association import ivf_search

    rec = out["ivf_recall"]
    rows = np.arange(80, 256)
    assert rec["row"].to_pylist() == rows.tolist() and rec["key"].to_pylist() == ivf_search.row_keys("h", rows).tolist()
    assert set(zip(rec["history_id"].to_pylist(), rec["first_session"].to_pylist(), rec["end_session"].to_pylist())) \
        == {("h", 0, 64)}
    # a rare row (session 8j+7 past the exact prefix's 20 sessions: j >= 2) finds its 4j, every other row its 30
    want = [4 * (s // 8) if s % 8 == 7 else 30 for s in rows // 4]
    assert rec["hits"].to_pylist() == want and rec["total"].to_pylist() == [30] * 176
    # the driver's sample size (params): the rows of the 10 smallest keys, with their own counts
    out = AssociateStage.run(None, {"segments": [["h", 0, 64, "d64"]], "matrices": [E],
                                    "indexes": [{"saved": None, "digest": "d0"}]},
                             {"association": a, "device": "cpu", "recall_rows": 10})
    keys = ivf_search.row_keys("h", rows)
    pick = np.sort(rows[np.argsort(keys)[:10]])
    assert out["ivf_recall"]["row"].to_pylist() == pick.tolist()
    assert out["ivf_recall"]["hits"].to_pylist() == [want[r - 80] for r in pick]
    idx = out["ivf_index"].to_pylist()
    assert [(r["history_id"], r["end_session"], r["sessions"], r["prefix_digest"]) for r in idx] == [("h", 64, 0, "d0")]


def test_an_old_banks_per_segment_recall_parts_are_never_current_and_are_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bank associated under IVF before the recall sample was stored per node row: its parts are named by
    the key without the sample's entry, its ``ivf_recall`` parts have the old schema (one row per segment).
    Under the new key none of them is current: the stage recomputes the IVF history from session 0, then
    drops every old part, ending with a fresh build's rows. The exact search's key has no such entry."""
    import pyarrow as pa

    from memgas.jobs import tables
    from memgas.jobs.stages.associate import AssociateStage
    from memgas.pipeline import schema
    from memgas.pipeline.association import ivf_search

    from .test_node_blocks import (
        ASSOCIATE_TABLES,
        GRID,
        IVF_SMALL,
        associate_ctx,
        associate_rows,
        run_associate,
        seeded_bank,
    )

    monkeypatch.setattr(ivf_search, "STAGE_BLOCK_SESSIONS", GRID)
    fresh, _ = seeded_bank(tmp_path / "fresh", {"h": 130})
    _, fresh_stats = run_associate(associate_ctx(fresh, IVF_SMALL))
    old, _ = seeded_bank(tmp_path / "old", {"h": 130})
    ctx = associate_ctx(old, IVF_SMALL)
    stage = AssociateStage()
    active = stage.active(ctx)
    new_key = tables.stage_key(stage, ctx, active)
    del active.resolved["recall_sample"]
    old_key = tables.stage_key(stage, ctx, active)
    exact = stage.active(associate_ctx(old, {}))
    assert "recall_sample" not in exact.resolved and "recall_rows" not in exact.params
    for name in ("edges", "edge_segments", "ivf_index"):
        for part in fresh.parts(name):
            old.write_part(name, part.replace(new_key, old_key), fresh.read(name, parts=[part]))
    monkeypatch.setitem(schema.TABLES, "ivf_recall", pa.schema(
        [("history_id", pa.string()), ("first_session", pa.int32()), ("end_session", pa.int32()),
         ("rows", pa.int32()), ("hits", pa.int64()), ("total", pa.int64())]))
    for part in fresh.parts("ivf_recall"):
        t = fresh.read("ivf_recall", parts=[part])
        old.write_part("ivf_recall", part.replace(new_key, old_key), pa.table(
            {"history_id": ["h"], "first_session": [0], "end_session": [130], "rows": [t.num_rows],
             "hits": [sum(t["hits"].to_pylist())], "total": [sum(t["total"].to_pylist())]}))
    monkeypatch.setitem(schema.TABLES, "ivf_recall", schema.IVF_RECALL)
    assert all(p.startswith(f"associate-{old_key}-") for name in ASSOCIATE_TABLES for p in old.parts(name))
    units, stats = run_associate(associate_ctx(old, IVF_SMALL))
    assert [s[:3] for u in units for s in u["segments"]] == [["h", 0, 130]]
    parts = [p for name in ASSOCIATE_TABLES for p in old.parts(name)]
    assert len(parts) == 4 and all(p.startswith(f"associate-{new_key}-") for p in parts)
    assert associate_rows(old) == associate_rows(fresh)
    recall = {k: v for k, v in stats.items() if k.startswith("ivf_recall")}
    assert recall == {k: v for k, v in fresh_stats.items() if k.startswith("ivf_recall")} and recall


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
        assert got == want and (got or table == "ivf_delta"), table  # a fresh build saves no delta


@pytest.mark.slow
def test_ivf_histories_cut_into_units_through_the_cli_equal_one_unit(tmp_path: Path, built: dict[str, Any],
                                                                     cli: Callable,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Real MiniLM vectors through `memgas index`: the fresh bank's association dropped, then rebuilt with each
    history cut at every 8 sessions (h0: 4 units, h1: 4) and node blocks of 2 sessions. Edges and saved indexes
    are those of one unit per history, byte for byte."""
    from memgas.pipeline.association import blocks, segments

    small_ivf(monkeypatch)
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
    # more rows stored (each unit's bottom-k), the same sample and recall as one unit per history
    assert len(_rows(bank, "ivf_recall")) > len(_rows(built["fresh"], "ivf_recall"))
    recall = {k: v for k, v in _associate_stats(bank).items() if k.startswith("ivf_recall")}
    assert recall == {k: v for k, v in built["stats_fresh"].items() if k.startswith("ivf_recall")} and recall

"""memgas-cards: JustMem's cards as a fifth MemGAS granularity, in its own stages
(card-graph-encode, card-graph-associate, card-graph-rank). Selected, it ranks through the job like the other
methods; not selected, every existing stage keeps its fingerprint; a change of the cards re-runs only what
depends on them, never plain MemGAS."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from memgas.jobs import stages as S
from memgas.jobs import tables
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs import runner
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.methods import get_method
from tests.jobs.test_justmem_stages import _ctx, _rankings
from tests.jobs.test_stages import _base, _fingerprints, _record, _run, fake_bank  # noqa: F401

CARD_GRAPH_STAGES = ("card-graph-encode", "card-graph-associate", "card-graph-rank")
METHODS = ["session", "memgas", "memgas-cards"]


def _mc(tmp: Path, **extra: object) -> MemgasConfig:
    return _base(tmp, **{"retrieval.methods": METHODS, **extra})


def test_memgas_cards_is_a_method_of_its_own_family() -> None:
    m = get_method("memgas-cards")
    assert (m.family, m.edges, m.ppr, m.router, m.reads_cards) == ("memgas-cards", "gmm", True, True, False)
    assert not m.is_graph  # not one of the four-granularity methods: rank_history refuses it


def test_without_memgas_cards_every_existing_fingerprint_is_unchanged(tmp_path, fake_bank) -> None:
    """Not selected: the card-graph stages are disabled and every other step has the fingerprint it has in a
    pipeline without them (same tables, same keys), with and without JustMem methods."""
    old = tuple(s for s in S.PIPELINE if s.name not in CARD_GRAPH_STAGES)
    for cfg in (_base(tmp_path), _base(tmp_path, **{"retrieval.methods": ["memgas", "cards", "justmem"]})):
        now = _fingerprints(cfg, fake_bank)
        assert {s: now[s] for s in CARD_GRAPH_STAGES} == {s: "disabled" for s in CARD_GRAPH_STAGES}
        ctx = StageContext(cfg, fake_bank, None, use_ray=False, pipeline=old)
        resolve_stage_runtimes(ctx)
        assert {s: f for s, f in now.items() if s not in CARD_GRAPH_STAGES} == runner.compute_fingerprints(ctx)


def test_selecting_memgas_cards_adds_its_stages_and_the_cards_only(tmp_path, fake_bank) -> None:
    plain = _fingerprints(_base(tmp_path, **{"retrieval.methods": ["session", "memgas"]}), fake_bank)
    mc = _fingerprints(_mc(tmp_path), fake_bank)
    assert "disabled" not in [mc[s] for s in ("cards", *CARD_GRAPH_STAGES)]
    assert mc["plan"] == mc["card-encode"] == mc["card-rank"] == "disabled"  # no JustMem method: no planner
    # MemGAS's own stages are untouched: rank keys only the MemGAS subset of retrieval.methods
    changed = sorted(s for s in plain if plain[s] != mc[s])
    assert changed == sorted(["cards", *CARD_GRAPH_STAGES, "evaluate"])


# (field, value, stages whose fingerprint changes) with memgas-cards selected beside MemGAS methods
MC_CASES: list[tuple[str, object, list[str]]] = [
    # the cards change: only what depends on them (never plain MemGAS's associate, rank or read)
    ("justmem.extractor", "llm", ["cards", *CARD_GRAPH_STAGES]),
    ("justmem.planner", "llm", []),  # no JustMem method: the planner does not run
    ("justmem.candidates", 20, []),
    ("association.mem_threshold", 20, ["associate", "rank", "read", "card-graph-associate", "card-graph-rank"]),
    ("association.min_prior_nodes", 10, ["associate", "rank", "read", "card-graph-associate", "card-graph-rank"]),
    ("association.topk_edges", 3, ["associate", "rank", "read"]),  # the card graph keeps the GMM's edges only
    ("retrieval.num_seeds", 10, ["rank", "read", "card-graph-rank"]),
    ("retrieval.temp", 0.5, ["rank", "read", "card-graph-rank"]),
    ("retrieval.card_graph_entropy", "raw", ["card-graph-rank"]),  # memgas-cards' router only
    ("retrieval.store_top", 40, ["rank", "read", "card-graph-rank"]),
    ("retrieval.methods", ["session", "memgas", "memgas-cards", "turn"], ["rank", "read"]),
    ("encoder.max_tokens", 128, ["encode", "associate", "rank", "read", *CARD_GRAPH_STAGES]),
]


@pytest.mark.parametrize("field,value,expected", MC_CASES, ids=[c[0] for c in MC_CASES])
def test_memgas_cards_fields_change_exactly_their_stages(tmp_path, fake_bank, field, value, expected) -> None:
    expected = sorted({*expected, "evaluate"}) if expected else []
    base = _fingerprints(_mc(tmp_path), fake_bank)
    changed = _fingerprints(_mc(tmp_path, **{field: value}), fake_bank)
    got = sorted(s for s in base if base[s] != changed[s])
    if field.startswith("encoder.") and "generate" in got:  # the LLM-free summary ranks with the encoder
        expected = sorted({*expected, "generate", "nodes"})
    assert got == expected


@pytest.fixture(scope="module")
def mc_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mc")
    _run(_mc(out, **{"reading.enabled": False}))  # no LLM: the run tests ranking only
    return out


@pytest.mark.slow
def test_a_run_ranks_memgas_cards_and_equals_the_library(mc_run) -> None:
    """Through the job: the card-graph stages run, metrics.json scores memgas-cards beside MemGAS, and its
    stored rankings are exactly the library's over each whole history (so they do not depend on how the
    histories were sharded or batched)."""
    from memgas.jobs.stages.card_graph import history_card_graph
    from memgas.kernels.backend import one_blas_thread
    from memgas.pipeline.card_graph import card_graph_edges, rank_card_graph

    rec = _record(mc_run)
    for stage in ("cards", *CARD_GRAPH_STAGES):
        assert rec[stage]["status"] == "executed", (stage, rec[stage])
    assert rec["plan"]["status"] == rec["card-rank"]["status"] == "disabled"
    metrics = json.loads((mc_run / "metrics.json").read_text())
    assert set(metrics["retrieval"]["session"]) == set(METHODS)
    cfg = _mc(mc_run, **{"reading.enabled": False})
    ctx = _ctx(cfg, mc_run)
    got = ctx.results.read("rankings", parts=tables.current_parts(ctx, "card_graph_rankings")).to_pandas()
    assert set(got["method"]) == {"memgas-cards"}
    edges = tables.read_current(ctx, "card_graph_edges", columns=["src"]).num_rows  # counted from the parts' metadata
    assert metrics["stages"]["card-graph-associate"]["extra"]["edges_gmm"] == edges > 0
    assert set(_rankings(ctx)["method"]) == {"session", "memgas"}  # MemGAS's writers hold none of its rows
    assert len(got) > 0
    r, a = cfg.retrieval, cfg.association
    for h, graph, sids, qids, qv in history_card_graph(ctx):
        assert graph.n_cards > 0 and graph.gran.max() == 4
        src, dst = card_graph_edges(graph, mem_threshold=a.mem_threshold, min_prior_nodes=a.min_prior_nodes)
        assert np.isin(4, graph.gran[np.concatenate([src, dst])])  # cards are associated like any node
        with one_blas_thread():  # as the stage's worker: BLAS's thread count may change a product's last bit
            order, scores = rank_card_graph(graph, qv, src, dst, num_seeds=r.num_seeds, damping=r.damping,
                                            temp=r.temp, router=r.router, entropy=r.card_graph_entropy)
        top = min(r.store_top, len(sids))
        for qi, qid in enumerate(qids):
            mine = got[got["query_id"] == qid].sort_values("rank")
            assert mine["session_id"].tolist() == [sids[i] for i in order[qi, :top]], qid
            assert mine["score"].tolist() == scores[qi, order[qi, :top]].tolist(), qid


def test_reading_memgas_cards_is_refused_in_one_line(tmp_path) -> None:
    """memgas-cards is ranked only: a reader of its rankings does not exist yet, so reading.methods naming it is
    a config error (exit 2 from the CLI), not a run that silently answers nothing for it."""
    from memgas.pipeline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"reading.methods names \['memgas-cards'\], which is ranked only"):
        _mc(tmp_path, **{"reading.methods": ["memgas", "memgas-cards"]})
    _mc(tmp_path, **{"reading.methods": ["memgas", "memgas-cards"], "reading.enabled": False})  # not read: fine


def test_the_rank_stage_ranks_with_the_configured_entropy() -> None:
    """card-graph-rank's worker passes ``retrieval.card_graph_entropy`` to the library: its rows under
    "normalised" are rank_card_graph's with entropy="normalised" (and differ from "raw" on this graph)."""
    from memgas.jobs.stages.card_graph_rank import CardGraphRankStage
    from memgas.pipeline.card_graph import rank_card_graph
    from memgas.pipeline.config import RetrievalConfig
    from tests.pipeline.test_card_graph import _graph

    g, q = _graph()
    none = np.zeros(0, np.int64)
    sids, qids = ["s0", "s1", "s2"], ["q0", "q1"]
    payload = {"histories": [{"graph": g.to_arrays(), "session_ids": sids, "query_ids": qids, "queries": q,
                              "edges": (none, none)}]}
    rows = {}
    for entropy in ("raw", "normalised"):
        r = {**RetrievalConfig().model_dump(), "methods": ["memgas-cards"], "card_graph_entropy": entropy}
        got = CardGraphRankStage.run(None, payload, {"retrieval": r, "device": "cpu"})["rankings"].to_pandas()
        order, scores = rank_card_graph(g, q, none, none, num_seeds=r["num_seeds"], damping=r["damping"],
                                        temp=r["temp"], router=r["router"], entropy=entropy)
        for qi, qid in enumerate(qids):
            mine = got[got["query_id"] == qid].sort_values("rank")
            assert mine["session_id"].tolist() == [sids[i] for i in order[qi]]
            assert mine["score"].tolist() == scores[qi, order[qi]].tolist()
        rows[entropy] = got["score"].tolist()
    assert rows["raw"] != rows["normalised"]

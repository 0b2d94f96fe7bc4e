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
from memgas.jobs.stages.read import current_answers
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.methods import get_method
from tests.jobs.test_justmem_stages import _ctx, _rankings
from tests.jobs.test_stages import _base, _fingerprints, _record, _run, fake_bank  # noqa: F401

CARD_GRAPH_STAGES = ("card-graph-encode", "card-graph-associate", "card-graph-rank")
READER = "card-graph-read"
#: every stage of memgas-cards: its index, ranker and reader
ALL_STAGES = (*CARD_GRAPH_STAGES, READER)
METHODS = ["session", "memgas", "memgas-cards"]


def _mc(tmp: Path, **extra: object) -> MemgasConfig:
    return _base(tmp, **{"retrieval.methods": METHODS, **extra})


def _without_card_graph() -> tuple:
    """The pipeline as it is without memgas-cards: no card-graph stage, and no read of their tables (the judge
    and the report name memgas-cards' answers and picks)."""
    import copy

    own = {t.name for s in S.PIPELINE if s.name in ALL_STAGES for t in s.writes}
    out = []
    for step in S.PIPELINE:
        if step.name in ALL_STAGES:
            continue
        if own & set(getattr(step, "reads", ())):
            step = copy.copy(step)
            step.reads = tuple(r for r in step.reads if r not in own)
        out.append(step)
    return tuple(out)


def test_memgas_cards_is_a_method_of_its_own_family() -> None:
    m = get_method("memgas-cards")
    assert (m.family, m.edges, m.ppr, m.router, m.reads_cards) == ("memgas-cards", "gmm", True, True, False)
    assert not m.is_graph  # not one of the four-granularity methods: rank_history refuses it


def test_without_memgas_cards_every_existing_fingerprint_is_unchanged(tmp_path, fake_bank) -> None:
    """Not selected: the card-graph stages are disabled and every other step has the fingerprint it has in a
    pipeline without them (same tables, same keys), with and without JustMem methods."""
    old = _without_card_graph()
    for cfg in (_base(tmp_path), _base(tmp_path, **{"retrieval.methods": ["memgas", "cards", "justmem"]})):
        now = _fingerprints(cfg, fake_bank)
        assert {s: now[s] for s in ALL_STAGES} == {s: "disabled" for s in ALL_STAGES}
        ctx = StageContext(cfg, fake_bank, None, use_ray=False, pipeline=old)
        resolve_stage_runtimes(ctx)
        assert {s: f for s, f in now.items() if s not in ALL_STAGES} == runner.compute_fingerprints(ctx)


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
    # the IVF search past the exact prefix: both graphs' associations (and what reads them); its parameters
    # change nothing under the exact search
    ("association.search", "ivf", ["associate", "rank", "read", "card-graph-associate", "card-graph-rank"]),
    ("association.ivf_nlist", 64, []),
    ("retrieval.num_seeds", 10, ["rank", "read", "card-graph-rank"]),
    ("retrieval.temp", 0.5, ["rank", "read", "card-graph-rank"]),
    ("retrieval.card_graph_entropy", "raw", ["card-graph-rank"]),  # memgas-cards' router only
    ("retrieval.card_graph_picks", 3, ["card-graph-rank"]),  # its picks (rankings' rows unchanged), not read here
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


#: memgas-cards read beside MemGAS's reader
READ_BOTH = {"reading.methods": ["memgas", "memgas-cards"]}


def test_selecting_memgas_cards_to_read_adds_its_reader_only(tmp_path, fake_bank) -> None:
    """memgas-cards in reading.methods: its reader runs, and no other stage changes its fingerprint but those that
    read every reader's answers (the judge, the report)."""
    for judge in (False, True):
        base = _fingerprints(_mc(tmp_path, **{"evaluation.judge": judge}), fake_bank)
        read = _fingerprints(_mc(tmp_path, **READ_BOTH, **{"evaluation.judge": judge}), fake_bank)
        assert base[READER] == "disabled" != read[READER]
        assert sorted(s for s in base if base[s] != read[s]) == sorted([READER, "evaluate", *(["judge"] * judge)])


# (field, value, stages whose fingerprint changes) with memgas-cards ranked and read beside MemGAS
MC_READ_CASES: list[tuple[str, object, list[str]]] = [
    # the reading budget and the LLM: both readers, nothing upstream
    ("reading.top_k", 2, ["read", READER]),
    ("reading.context_tokens", 1500, ["read", READER]),
    ("reading.max_new_tokens", 24, ["read", READER]),
    ("reading.filter", True, ["read", READER]),
    ("reading.max_questions", 3, ["read", READER]),
    ("llm.model", "other", ["read", READER]),
    ("reading.methods", ["memgas-cards"], ["read"]),  # MemGAS's reader off: memgas-cards' reader as it was
    # what ranks memgas-cards: its ranker and reader
    ("retrieval.card_graph_picks", 3, ["card-graph-rank", READER]),
    ("retrieval.card_graph_entropy", "raw", ["card-graph-rank", READER]),
    ("retrieval.num_seeds", 10, ["rank", "read", "card-graph-rank", READER]),
    ("justmem.extractor", "llm", ["cards", *CARD_GRAPH_STAGES, READER]),
    ("justmem.replay_tokens", 256, []),  # JustMem's card readers' only
    ("justmem.top_k", 5, []),
]


@pytest.mark.parametrize("field,value,expected", MC_READ_CASES, ids=[c[0] for c in MC_READ_CASES])
def test_memgas_cards_reader_fields_change_exactly_their_stages(tmp_path, fake_bank, field, value, expected) -> None:
    expected = sorted({*expected, "evaluate"}) if expected else []
    base = _fingerprints(_mc(tmp_path, **READ_BOTH), fake_bank)
    changed = _fingerprints(_mc(tmp_path, **{**READ_BOTH, field: value}), fake_bank)
    assert sorted(s for s in base if base[s] != changed[s]) == expected


def test_reading_memgas_cards_is_accepted_and_a_bad_name_is_refused(tmp_path) -> None:
    """memgas-cards is read like any ranked method; a name no method has, or a method read but not ranked, is a
    config error naming it (exit 2 from the CLI)."""
    from memgas.pipeline.errors import ConfigError

    assert _mc(tmp_path, **READ_BOTH).reading.methods == ["memgas", "memgas-cards"]
    with pytest.raises(ConfigError, match=r"unknown method\(s\) memgas-card;"):
        _mc(tmp_path, **{"reading.methods": ["memgas-card"]})
    with pytest.raises(ConfigError, match=r"reading.methods names \['memgas-cards'\], which retrieval.methods .* "
                                          r"does not rank"):
        _base(tmp_path, **READ_BOTH)


def _mcr(tmp: Path, **extra: object) -> MemgasConfig:
    """memgas-cards ranked and read (alone: MemGAS's reader has tests of its own), three questions (a CPU answer
    takes ~1 s), its three top sessions in a 512-token window (the budget binds: sessions are dropped or cut)."""
    return _mc(tmp, **{"reading.methods": ["memgas-cards"], "reading.top_k": 3, "reading.max_questions": 3, **extra})


@pytest.fixture(scope="module")
def mc_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mc")
    _run(_mcr(out))
    return out


@pytest.mark.slow
def test_a_run_ranks_memgas_cards_and_equals_the_library(mc_run) -> None:
    """Through the job: the card-graph stages run, metrics.json scores memgas-cards beside MemGAS, and its
    stored rankings are exactly the library's over each whole history (so they do not depend on how the
    histories were sharded or batched); so are its card picks (the cards of most PPR mass of each stored session)."""
    from memgas.jobs.stages.card_graph import history_card_graph
    from memgas.kernels.backend import one_blas_thread
    from memgas.pipeline.card_graph import CARD, card_graph_edges, card_graph_ppr, session_card_picks

    rec = _record(mc_run)
    for stage in ("cards", *CARD_GRAPH_STAGES):
        assert rec[stage]["status"] == "executed", (stage, rec[stage])
    assert rec["plan"]["status"] == rec["card-rank"]["status"] == "disabled"
    metrics = json.loads((mc_run / "metrics.json").read_text())
    assert set(metrics["retrieval"]["session"]) == set(METHODS)
    cfg = _mcr(mc_run)
    ctx = _ctx(cfg, mc_run)
    got = ctx.results.read("rankings", parts=tables.current_parts(ctx, "card_graph_rankings")).to_pandas()
    assert set(got["method"]) == {"memgas-cards"}
    edges = tables.read_current(ctx, "card_graph_edges", columns=["src"]).num_rows  # counted from the parts' metadata
    assert metrics["stages"]["card-graph-associate"]["extra"]["edges_gmm"] == edges > 0
    assert set(_rankings(ctx)["method"]) == {"session", "memgas"}  # MemGAS's writers hold none of its rows
    assert len(got) > 0
    picks = tables.read_current(ctx, "card_graph_picks").to_pandas()
    r, a = cfg.retrieval, cfg.association
    card_ids: dict[str, list[str]] = {}
    for h, graph, sids, qids, qv in history_card_graph(ctx, card_ids=card_ids):
        assert graph.n_cards > 0 and graph.gran.max() == 4
        src, dst = card_graph_edges(graph, mem_threshold=a.mem_threshold, min_prior_nodes=a.min_prior_nodes)
        assert np.isin(4, graph.gran[np.concatenate([src, dst])])  # cards are associated like any node
        with one_blas_thread():  # as the stage's worker: BLAS's thread count may change a product's last bit
            order, scores, mass = card_graph_ppr(graph, qv, src, dst, num_seeds=r.num_seeds, damping=r.damping,
                                                 temp=r.temp, router=r.router, entropy=r.card_graph_entropy)
        top = min(r.store_top, len(sids))
        card_of = dict(zip(np.flatnonzero(graph.gran == CARD).tolist(), card_ids[h]))
        for qi, qid in enumerate(qids):
            mine = got[got["query_id"] == qid].sort_values("rank")
            assert mine["session_id"].tolist() == [sids[i] for i in order[qi, :top]], qid
            assert mine["score"].tolist() == scores[qi, order[qi, :top]].tolist(), qid
            ranks, nodes = session_card_picks(graph, order, mass, top, r.card_graph_picks)[qi]
            want = [(int(k) + 1, sids[order[qi, k]], card_of[n], mass[qi, n]) for k, n in zip(ranks, nodes)]
            rows = picks[picks["query_id"] == qid].sort_values(["rank", "card_rank"])
            assert list(zip(rows["rank"], rows["session_id"], rows["card_id"], rows["mass"])) == want, qid
            assert rows.groupby("rank")["card_rank"].apply(list).tolist() == [
                list(range(1, n + 1)) for n in np.bincount(ranks)[np.unique(ranks)]], qid
    assert len(picks) > 0


@pytest.mark.slow
def test_a_run_reads_memgas_cards_and_reports_it_like_every_method(mc_run) -> None:
    """Every question answered by memgas-cards' reader, and its answers, LLM tokens and the evidence in its
    reader's context in metrics.json and report.md like every other method's."""
    from memgas.pipeline.read import is_failed_answer

    rec = _record(mc_run)
    assert rec[READER]["status"] == "executed" and rec["read"]["status"] == "disabled"
    ctx = _ctx(_mcr(mc_run), mc_run)
    ans = current_answers(ctx).to_pandas()
    qids = ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist()[:3]  # reading.max_questions
    assert sorted(ans["query_id"]) == sorted(qids) and set(ans["method"]) == {"memgas-cards"}
    assert not any(is_failed_answer(e) for e in ans["error"]) and all(ans["hypothesis"].str.len() > 0)
    metrics = json.loads((mc_run / "metrics.json").read_text())
    assert metrics["qa"]["memgas-cards"]["n"] == len(qids) and metrics["run"]["answered"] == len(qids)
    assert metrics["tokens"]["memgas-cards"]["answer"] == {"prompt": int(ans["prompt_tokens"].sum()),
                                                           "completion": int(ans["completion_tokens"].sum())}
    assert metrics["tokens"]["memgas-cards"]["answer"]["prompt"] > 0
    # the reader's context is measured for every question, read or not
    n_queries = ctx.bank.count("queries")
    reader = metrics["retrieval"]["session"]["memgas-cards"]["reader"]
    assert reader["n_evaluated"] + sum(reader["skipped"].values()) == n_queries and reader["n_evaluated"] > 0
    assert reader["overall"]["context_tokens"] > 0
    report = (mc_run / "report.md").read_text()
    # its rows: retrieval (with the reader's context), question answering, LLM tokens
    assert sum(line.startswith("| memgas-cards |") for line in report.splitlines()) >= 3


@pytest.mark.slow
def test_the_reader_gets_the_top_sessions_with_their_picks_within_the_budget(mc_run) -> None:
    """Per question, the answer model's context is exactly the method's top sessions in rank order, each block
    with its picks' card lines (pick order) before its text, as many whole blocks as fit the reading budget
    (counted by the reader's own tokenizer: the next block would not), or the top block's head when it alone
    does not fit; and the prompt the backend counted fits the window beside max_new_tokens."""
    from memgas.jobs.models import make_model
    from memgas.jobs.placement import placement
    from memgas.pipeline.prompts import CARD_GRAPH_CARDS_HEAD, answer_prompt, session_block
    from memgas.pipeline.read import MARGIN

    cfg = _mcr(mc_run)
    ctx = _ctx(cfg, mc_run)
    stage = next(s for s in ctx.pipeline if s.name == READER)
    llm = make_model("llm", placement(stage, stage.active(ctx), ctx).config)  # the reader's own (loaded by the run)
    picks = tables.read_current(ctx, "card_graph_picks").to_pandas()
    assert 0 < picks.groupby(["query_id", "rank"]).size().max() <= cfg.retrieval.card_graph_picks
    card_text = dict(zip(*ctx.bank.read("cards", ["card_id", "text"]).to_pydict().values()))
    ranks = ctx.results.read("rankings", parts=tables.current_parts(ctx, "card_graph_rankings")).to_pandas()
    window = min(cfg.reading.context_tokens, cfg.llm.context_tokens)
    kept = []
    for a in current_answers(ctx).to_pandas().itertuples():
        q = stage.inputs(ctx, {"method": "memgas-cards", "queries": [a.query_id]})["queries"][0]
        top = ranks[(ranks["query_id"] == a.query_id) & (ranks["rank"] <= cfg.reading.top_k)].sort_values("rank")
        assert [s["session_id"] for s in q["sessions"]] == top["session_id"].tolist() == a.retrieved_session_ids.tolist()
        for r, s in enumerate(q["sessions"], 1):
            mine = picks[(picks["query_id"] == a.query_id) & (picks["rank"] == r)].sort_values("card_rank")
            assert set(mine["session_id"]) <= {s["session_id"]}
            lines = s["cards"].split("\n") if s.get("cards") else []
            assert len(lines) == len(mine)
            for k, (line, c) in enumerate(zip(lines, mine["card_id"]), 1):
                assert line.startswith(f"[{k}] (") and line.endswith(f") {card_text[c]}"), (a.query_id, r, k)
        blocks = [session_block(s["date"], s["text"], cards=s.get("cards")) for s in q["sessions"]]
        budget = (window - cfg.reading.max_new_tokens - MARGIN
                  - llm.count_tokens(answer_prompt("", q["question"], q["question_date"])[0]["content"]))
        text = a.filtered_context
        assert llm.count_tokens(text) <= budget, a.query_id
        n = next((i for i in range(len(blocks), 0, -1) if "".join(blocks[:i]) == text), 0)
        if n:
            assert n == len(blocks) or llm.count_tokens("".join(blocks[: n + 1])) > budget, a.query_id
        else:  # the top session alone does not fit: its head, its cards first
            assert blocks[0].startswith(text) and llm.count_tokens(blocks[0]) > budget, a.query_id
            if q["sessions"][0].get("cards"):
                assert text.index(CARD_GRAPH_CARDS_HEAD) < len(text), a.query_id
        assert a.prompt_tokens + cfg.reading.max_new_tokens <= window, a.query_id
        kept.append(n)
    assert min(kept) < cfg.reading.top_k  # the budget bound somewhere


@pytest.mark.slow
def test_its_reader_resumes_is_skipped_and_re_runs_alone_on_a_reading_change(tmp_path_factory, mc_run,
                                                                             monkeypatch) -> None:
    """The reader's answers removed: a run that fails after its 2nd unit keeps those units, the next runs the
    rest only and ends with the reference's answers (part bytes too); a re-run skips it; a reading field runs
    it alone again."""
    import shutil

    from memgas.pipeline import faults
    from tests.jobs.test_stages import _executed, _outputs

    work = tmp_path_factory.mktemp("mcread")
    shutil.copytree(mc_run, work, dirs_exist_ok=True)
    mine = sorted((work / "results" / "answers").glob(f"{READER}-*.parquet"))
    assert len(mine) > 2, "the reference run wrote too few answer parts: nothing tested"
    before = {p.name: p.read_bytes() for p in mine}
    for p in mine:
        p.unlink()
    (work / "results" / "_stages" / f"{READER}.json").unlink()
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MEMGAS_FAULT", f"raise@{READER}:unit-done#2")
    with pytest.raises(Exception, match=f"injected failure at {READER}:unit-done"):
        _run(_mcr(work))
    monkeypatch.delenv("MEMGAS_FAULT")
    _run(_mcr(work))
    rec = _record(work)[READER]
    assert rec["status"] == "executed" and rec["units_resumed"] == 2 and rec["units_done"] == len(mine) - 2
    assert _executed(work) == [READER]
    assert {p.name: p.read_bytes() for p in sorted((work / "results" / "answers").glob(f"{READER}-*"))} == before
    assert _outputs(work) == _outputs(mc_run)
    _run(_mcr(work))
    assert _executed(work) == []
    _run(_mcr(work, **{"reading.max_questions": 1}))
    assert _executed(work) == [READER] and _record(work)[READER]["units_done"] == 1


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
                              "edges": (none, none), "card_ids": [f"c{i}" for i in range(g.n_cards)]}]}
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

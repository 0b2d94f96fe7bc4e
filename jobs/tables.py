"""Tables, the unit of data flow, and their kinds: the one place that names parts, compacts, drops stale
parts and digests what a stage committed.

A :class:`Table` (defined in :mod:`memgas.jobs.stage`) is declared by the stage that writes it (each table
has exactly one writer); stages read tables by name or by role (:func:`ranking`), and their driver code
opens only those (:class:`GuardedBank`). Several tables may be stored in one bank table (``stored_in``): the MemGAS and JustMem
encoders both write ``embeddings``, the MemGAS and JustMem rankers both write ``rankings``. Kinds:

* ``source``: the ingested dataset's tables, held by the bank (:class:`memgas.jobs.stage.Source`);
* ``content``: content-addressed rows keyed by text (or input) hash plus the producer's key (generations,
  cards, embeddings), shared by every config and dataset that produces the same rows. Parts are compacted
  into one sorted part after the stage; what the stage committed is the digest of *this config's rows*
  (``rows``), verified by reading them again: another config's rows, or another writer's compaction of
  the same bank table, change nothing downstream;
* ``fingerprint``: rows of one fingerprint (plans, nodes, rankings, answers, judgments): parts named
  ``<stage>-<fingerprint>-...``; after the stage the writer's parts of other fingerprints are dropped;
  what it committed is the digest of its parts' bytes, recorded in its marker and verified before use;
* ``segmented``: rows valid while a prefix of their history is unchanged (association edges, see
  :mod:`memgas.pipeline.association.segments`), or while the inputs of their histories are (the rankers'
  tables, :mod:`memgas.jobs.stages.ranked`): parts named by the writer's key (not its fingerprint: an
  append keeps the old segments and rankings), current parts chosen by ``current``, every other part dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
from memgas.jobs.stage import Active, Report, Stage, StageContext, Table, config_value, short_hash, table_digest
from memgas.pipeline.bank import INGEST_PREFIX, INGEST_TABLES, Bank

# -- who writes what ------------------------------------------------------------------------------------
def enabled(ctx: StageContext, step: Any) -> bool:
    return ctx.fingerprints.get(step.name) != "disabled"


def writer_of(ctx: StageContext, name: str) -> Any:
    """The step of ``ctx.pipeline`` that writes table ``name``."""
    for step in ctx.pipeline:
        if any(t.name == name for t in getattr(step, "writes", ())):
            return step
    raise KeyError(f"no step of the pipeline writes table {name!r}")


def table(ctx: StageContext, name: str) -> Table:
    return next(t for t in writer_of(ctx, name).writes if t.name == name)


def writers(ctx: StageContext, physical: str) -> Iterator[tuple[Any, Table]]:
    """(step, table) of every table of ``ctx.pipeline`` stored in bank table ``physical``."""
    for step in ctx.pipeline:
        for t in getattr(step, "writes", ()):
            if t.physical == physical:
                yield step, t


def store_of(ctx: StageContext, stage: Stage | Report) -> Bank | None:
    """The bank a stage writes to (its first table's store); None for a report or results without a run."""
    writes = getattr(stage, "writes", ())
    if writes and writes[0].store == "bank":
        return ctx.bank
    return ctx.results


# -- keys and fingerprints --------------------------------------------------------------------------------
def stage_key(stage: Stage | Report, ctx: StageContext, active: Active) -> str:
    """hash(name, version, values of the active fields, resolved facts): no upstream, no dataset."""
    fields = stage.fields if active.fields is None else active.fields
    values = {f: config_value(ctx.cfg, f) for f in fields}
    return short_hash([stage.name, getattr(stage, "version", "1"), values, active.resolved])


def read_digest(ctx: StageContext, name: str) -> str | None:
    """What the writer of table ``name`` committed (its fingerprint before it ran)."""
    w = writer_of(ctx, name)
    return ctx.outputs.get(w.name) or ctx.fingerprints.get(w.name)


def fingerprint(stage: Stage | Report, ctx: StageContext, active: Active) -> str:
    """hash(the stage's key, the digest of each table it reads)."""
    reads = declared_reads(ctx, stage, active)
    return short_hash([stage_key(stage, ctx, active), {t: read_digest(ctx, t) for t in sorted(reads)}])


# -- what a step reads ------------------------------------------------------------------------------------
#: the prefix of a declared read that names a role, not a table (:func:`ranking`)
RANKING_ROLE = "ranking:"


def ranking(family: str) -> str:
    """A declared read: the rankings of ``family``'s retrieval methods, i.e. the last table declared with
    ``ranks=family`` by a step before the reader whose config enables it (the ranker's, or a re-ranker's
    after it): readers name the role, so a stage added between the ranker and them needs no edit of theirs."""
    return f"{RANKING_ROLE}{family}"


def _enabled_by_config(ctx: StageContext, step: Any) -> bool:
    key = ("tables:active", step.name)
    if key not in ctx.cache:
        with unguarded(ctx):
            ctx.cache[key] = not isinstance(step, Stage) or step.active(ctx) is not None
    return ctx.cache[key]


def resolve(ctx: StageContext, name: str, reader: Any) -> str | None:
    """The table a declared read of ``reader`` names under this config (a role resolved, a name as it is;
    None for a role no step of the pipeline before it fills: it reads nothing there)."""
    if not name.startswith(RANKING_ROLE):
        return name
    family = name[len(RANKING_ROLE):]
    first = last = None
    for step in ctx.pipeline:
        if step is reader:
            break
        for t in getattr(step, "writes", ()):
            if t.ranks == family:
                first = first or t.name
                last = t.name if _enabled_by_config(ctx, step) else last
    return last or first


def may_fill(ctx: StageContext, step: Any) -> set[str]:
    """Every table a declared read of ``step`` may name under some config (a role: every table that can fill it)."""
    out = set()
    for name in getattr(step, "reads", ()):
        if not name.startswith(RANKING_ROLE):
            out.add(name)
            continue
        before = ctx.pipeline[:ctx.pipeline.index(step)] if step in ctx.pipeline else ctx.pipeline
        out |= {t.name for w in before for t in getattr(w, "writes", ()) if t.ranks == name[len(RANKING_ROLE):]}
    return out


def declared_reads(ctx: StageContext, step: Any, active: Active | None = None) -> tuple[str, ...]:
    """The tables ``step`` reads under this config: its declared reads, narrowed by ``active``, roles
    resolved (what its fingerprint hashes and what its driver code may open)."""
    reads = step.reads if active is None or active.reads is None else active.reads
    return tuple(t for t in dict.fromkeys(resolve(ctx, r, step) for r in reads) if t is not None)


#: Bank methods whose first argument names a bank table
TABLE_METHODS = frozenset({"read", "iter_read", "iter_groups", "iter_merged", "count", "exists", "parts", "has_part",
                           "part_digest", "current_digest", "verify_part", "compact", "write", "write_part",
                           "drop_part", "drop", "_read_part", "_rows", "part_rows", "_dir"})


class UndeclaredRead(RuntimeError):
    """A stage's driver code opened a table it does not declare (its fingerprint would not follow it)."""


class GuardedBank:
    """A bank as a stage's driver code sees it (``ctx.bank``, ``ctx.results`` in its ``active``, ``plan``,
    ``inputs`` and ``finish``): every method of :class:`~memgas.pipeline.bank.Bank`, but those that name a table
    (:data:`TABLE_METHODS`: ``read``, ``iter_read``, ``iter_merged``, ``count``, ``exists``, ``parts``, ...) open
    only the bank tables that hold what the stage may read under this config (:func:`readable`) or writes, and
    those no step writes (caches named by their inputs: ``node_blocks``); another raises :class:`UndeclaredRead`. The table helpers (:func:`read_current`, :func:`current_parts`) check the
    declared name itself and then read through the bank."""

    def __init__(self, bank: Bank, stage: str, names: frozenset[str], denied: frozenset[str]) -> None:
        self.raw, self.stage, self.names, self.denied = bank, stage, names, denied

    def check(self, name: str, physical: bool = True) -> None:
        if name in self.denied if physical else name not in self.names:
            raise UndeclaredRead(f"stage {self.stage!r} opened table {name!r}, which it does not read under this "
                                 f"config (it reads or writes: {', '.join(sorted(self.names)) or 'nothing'}); "
                                 "declare it in the stage's reads")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in ("raw", "stage", "names", "denied"):  # copy/pickle probe these
            raise AttributeError(attr)
        value = getattr(self.raw, attr)
        if attr not in TABLE_METHODS:
            return value

        def guarded(name: str, *args: Any, **kwargs: Any) -> Any:
            self.check(name)
            return value(name, *args, **kwargs)

        return guarded


def readable(ctx: StageContext, step: Any, active: Active | None = None) -> frozenset[str]:
    """The tables ``step``'s driver code may open under this config: those it reads (``active`` narrows its
    declared reads; None: all of them) and every other table of their writers (a writer's committed digest,
    which the fingerprint hashes, covers all its tables: the dataset's six, associate's edges and segments),
    and those it writes."""
    writers = {writer_of(ctx, t).name for t in declared_reads(ctx, step, active)}
    return frozenset({t.name for w in ctx.pipeline if w.name in writers for t in getattr(w, "writes", ())}
                     | {t.name for t in getattr(step, "writes", ())})


@contextmanager
def reading_as(ctx: StageContext, step: Any, active: Active | None = None) -> Iterator[None]:
    """Within: ``ctx.bank`` and ``ctx.results`` are :class:`GuardedBank` views that open only what ``step``
    may read under this config (:func:`readable`)."""
    names = readable(ctx, step, active)
    # the bank tables that hold another writer's output; a table no step writes is a cache named by its own
    # inputs (node_blocks: by the prefix digest of the nodes and the encoder keys), no stage's output
    written = {t.physical for w in ctx.pipeline for t in getattr(w, "writes", ())}
    denied = frozenset(written - {table(ctx, n).physical for n in names})
    bank, results = ctx.bank, ctx.results
    raw = getattr(bank, "raw", bank), getattr(results, "raw", results)
    ctx.bank = GuardedBank(raw[0], step.name, names, denied)
    ctx.results = None if raw[1] is None else GuardedBank(raw[1], step.name, names, denied)
    try:
        yield
    finally:
        ctx.bank, ctx.results = bank, results


@contextmanager
def unguarded(ctx: StageContext) -> Iterator[None]:
    """Within: the banks themselves (the tables' own machinery: a writer's ``current`` parts, its rows)."""
    bank, results = ctx.bank, ctx.results
    ctx.bank, ctx.results = getattr(bank, "raw", bank), getattr(results, "raw", results)
    try:
        yield
    finally:
        ctx.bank, ctx.results = bank, results


def may_read(ctx: StageContext, name: str) -> bool:
    """Whether the running step may open table ``name`` (always, outside a step's driver code)."""
    return not isinstance(ctx.bank, GuardedBank) or name in ctx.bank.names


def _check_read(ctx: StageContext, name: str) -> None:
    if isinstance(ctx.bank, GuardedBank):
        ctx.bank.check(name, physical=False)


# -- parts ------------------------------------------------------------------------------------------------
def prefix(stage: Stage, ctx: StageContext) -> str:
    """Name prefix of the stage's unit parts: by its key for segmented tables, else by its fingerprint."""
    by = ctx.keys[stage.name] if stage.writes[0].kind == "segmented" else ctx.fingerprints[stage.name]
    return f"{stage.name}-{by}-"


def name_units(stage: Stage, ctx: StageContext, units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Units with their part names: ``<prefix><tag->index-<digest of the unit>``. The digest: a plan made
    again with other unit sizes (a lost plan file, other histories in a shard) never mistakes another
    unit's part for its own."""
    out = []
    for i, u in enumerate(units):
        body = {k: v for k, v in u.items() if k != "tag"}
        tag = f"{u['tag']}-" if u.get("tag") else ""
        out.append({**body, "part": f"{prefix(stage, ctx)}{tag}{i:05d}-{short_hash(body, 4)}"})
    return out


def _own_parts(bank: Bank, physical: str) -> list[str]:
    """Parts of a bank table other than ingest's own (ingest's parts of ``texts`` are the source's)."""
    parts = bank.parts(physical)
    return [p for p in parts if not p.startswith(INGEST_PREFIX)] if physical in INGEST_TABLES else parts


def stage_parts(stage: Stage, ctx: StageContext, t: Table) -> list[str]:
    """The parts that hold the current rows ``stage`` wrote to table ``t``."""
    store = store_of(ctx, stage)
    if store is None or not store.exists(t.physical):
        return []
    if t.kind == "content":
        return _own_parts(store, t.physical)
    if t.kind == "segmented":
        return t.current(ctx, prefix(stage, ctx)) if t.current is not None else []
    p = prefix(stage, ctx)
    return [x for x in store.parts(t.physical) if x.startswith(p)]


def current_parts(ctx: StageContext, name: str) -> list[str]:
    """The current parts of table ``name`` (its writer's, when the writer is enabled)."""
    _check_read(ctx, name)
    w = writer_of(ctx, name)
    if not enabled(ctx, w):
        return []
    with unguarded(ctx):
        return stage_parts(w, ctx, table(ctx, name))


def read_current(ctx: StageContext, name: str, *, filter: Any = None, columns: list[str] | None = None) -> pa.Table:
    """The current rows of a per-fingerprint table (empty with the table's schema when it has none)."""
    from memgas.pipeline.schema import schema_for

    t = table(ctx, name)
    parts = current_parts(ctx, name)
    if not parts:
        empty = schema_for(t.physical).empty_table()
        return empty.select(columns) if columns else empty
    with unguarded(ctx):
        store = store_of(ctx, writer_of(ctx, name))
        return store.read(t.physical, columns, parts=parts, filter=filter)


def finish_tables(stage: Stage, ctx: StageContext) -> int:
    """After a stage's units: compact its content tables; drop its parts of other fingerprints (and, for
    segmented tables, every part that is not current). Returns the stale parts dropped from its first table."""
    store = store_of(ctx, stage)
    dropped = 0
    for i, t in enumerate(stage.writes):
        if t.kind == "content":
            if store.exists(t.physical):
                store.compact(t.physical)
            continue
        keep = set(stage_parts(stage, ctx, t))
        others = tuple(f"{s.name}-" for s, _ in writers(ctx, t.physical) if s is not stage)
        for part in store.parts(t.physical):
            if part in keep or (others and part.startswith(others)):
                continue
            if t.kind == "fingerprint" and not part.startswith(f"{stage.name}-") and others:
                continue  # a part of no writer of this pipeline's: not this stage's to judge
            store.drop_part(t.physical, part)
            dropped += i == 0
    return dropped


# -- what a stage committed ------------------------------------------------------------------------------
def output_parts(stage: Stage, ctx: StageContext) -> list[tuple[str, str]]:
    """(bank table, part) of every part that holds the stage's output, for its per-fingerprint and segmented
    tables (content tables are digested by their rows instead: their parts are compacted, also by others)."""
    return [(t.physical, p) for t in stage.writes if t.kind != "content" for p in stage_parts(stage, ctx, t)]


#: How a marker's content rows were digested (its ``rows_digest``): tables with a ``digest`` streamed in
#: chunks. Markers without it (written before) digested every table's rows at once (``table_digest``), which
#: held the rows and their Arrow IPC bytes in memory: 6.4 GB for the vectors of 108,000 sessions, so ~60 GB
#: at 10^6. Such a marker is still verified the old way (a bank indexed before is read as it was written).
#: ``streamed-2`` streams ``generations`` too (its rows at 10^6 sessions: ~2M generated texts). ``summed-1``:
#: tables with a ``summed`` digest use it (a sum of cached row hashes: an append reads no row it did not add).
DIGEST_METHODS = ("streamed-1", "streamed-2", "summed-1")
DIGEST_METHOD = DIGEST_METHODS[-1]
SUMMED_SINCE = "summed-1"


def _since(method: str | None, first: str) -> bool:
    return method in DIGEST_METHODS and DIGEST_METHODS.index(method) >= DIGEST_METHODS.index(first)


def rows_digest(t: Table, ctx: StageContext, method: str | None) -> str:
    """The digest of content table ``t``'s rows under this config, as a marker of digest ``method`` made it."""
    if t.summed is not None and _since(method, SUMMED_SINCE):
        return t.summed(ctx)
    if t.digest is not None and _since(method, t.digest_since):
        return t.digest(ctx)
    return table_digest(t.rows(ctx))


def output_digest(stage: Stage, ctx: StageContext, parts: dict[str, str], method: str | None = DIGEST_METHOD) -> str:
    """Digest of what the stage committed: its parts' digests and its content tables' rows under this config
    (``method``: one of :data:`DIGEST_METHODS`, the marker's; None for the digest of markers written before
    them)."""
    rows = [rows_digest(t, ctx, method) for t in stage.writes if t.kind == "content" and t.rows is not None]
    return short_hash([sorted(parts.items()), rows], 12)


def content_parts(stage: Stage, ctx: StageContext) -> dict[str, dict[str, str | None]]:
    """Per physical table that holds a content table of the stage with rows (:func:`output_digest` reads
    them): every completed part of it and its recorded digest. The rows' digest is a function of this and of
    what the stage's fingerprint covers (its key and the digests of the tables it reads, which decide which
    rows are its own): the runner's marker records it, so that a skipped stage whose parts are unchanged is
    not read and digested again (the rows of 10^5 sessions' vectors: ~8 s a command)."""
    store = store_of(ctx, stage)
    out: dict[str, dict[str, str | None]] = {}
    for t in stage.writes:
        if t.kind == "content" and t.rows is not None and t.physical not in out:
            parts = store.parts(t.physical) if store is not None and store.exists(t.physical) else []
            out[t.physical] = {p: store.part_digest(t.physical, p) for p in parts}
    return out


def has_content(stage: Stage) -> bool:
    return any(t.kind == "content" for t in stage.writes)


def damaged_content(stage: Stage, ctx: StageContext) -> str | None:
    """The first part of the stage's content tables whose bytes are not those written, or None."""
    store = store_of(ctx, stage)
    for t in stage.writes:
        if t.kind == "content" and store.exists(t.physical):
            for p in _own_parts(store, t.physical):
                if not store.verify_part(t.physical, p):
                    return f"{t.physical}/{p}"
    return None

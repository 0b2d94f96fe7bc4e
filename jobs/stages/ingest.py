"""The ingested dataset: the pipeline's source (held by the bank, verified by the runner, never run by it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memgas.jobs.stage import Source, StageContext, short_hash
from memgas.jobs.tables import Table
from memgas.pipeline.bank import INGEST_TABLES, Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError


class IngestSource(Source):
    """The dataset file becomes the bank's ingest tables (histories, sessions, texts, turns, pairs, queries),
    written by ``memgas ingest`` or by ``memgas run`` under the bank's lock (:func:`memgas.jobs.main_job.ensure_ingested`)."""

    name = "ingest"
    #: the config leaves that name the dataset (they key what the bank holds, not a stage's output)
    fields = ("data.path", "data.format", "data.limit", "data.strict")
    writes = tuple(Table(t, "source") for t in INGEST_TABLES)
    where = "driver"

    def fingerprint(self, ctx: StageContext) -> str:
        # what the bank holds, not what the config names: index/answer on an existing bank use the same key
        # (a grown bank: its whole ingest history, see dataset_identity; read from the manifest alone)
        from memgas.pipeline.append import dataset_digest, ingest_history

        datasets = ctx.bank.manifest.get("datasets") or []
        ds = (ingest_history(datasets) or [{}])[0]
        return short_hash([self.name, "1", dataset_digest(datasets), ds.get("format"), ds.get("limit"),
                           ds.get("strict")])

    def output(self, ctx: StageContext) -> str:
        return ingest_output(ctx.bank)

    def holds_config_dataset(self, ctx: StageContext) -> bool:
        from memgas.pipeline.append import ingest_history
        from memgas.pipeline.hashing import file_sha256

        refuse_grown_bank(ctx.cfg, ctx.bank)
        ds = (ingest_history(ctx.bank.manifest.get("datasets") or []) or [{}])[0]
        want = {"sha256": file_sha256(ctx.cfg.data.path), "format": ctx.cfg.data.format, "limit": ctx.cfg.data.limit,
                "strict": ctx.cfg.data.strict}
        return (all(ds.get(k) == v for k, v in want.items()) and ctx.bank.exists("sessions")
                and not ctx.bank.damaged_ingest_parts())

    def ingest(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.ingest import ingest

        cfg = ctx.cfg
        # lock=False: the runner took the bank's lock before deciding to ingest (main_job.run)
        summary = ingest(cfg.data.path, cfg.data.format, ctx.bank.path, strict=cfg.data.strict, limit=cfg.data.limit,
                         progress=True, lock=False)
        ds = (ctx.bank.manifest.get("datasets") or [{}])[-1]
        if ds.get("limit") != cfg.data.limit:  # record the limit so a later run knows what this bank holds
            ctx.bank.update_manifest(datasets=[{**ds, "limit": cfg.data.limit}])
        counts = summary.get("counts", {}) if isinstance(summary, dict) else {}
        return {"items": int(counts.get("sessions", 0)), "summary": summary}


def ingest_output(bank: Bank) -> str:
    """Digest of the bank's ingested dataset: its committed parts' bytes (verified) and the dataset record.
    The ingested data cannot be rebuilt from the bank: a missing or altered part is refused, naming a
    command that re-ingests."""
    from memgas.pipeline.append import dataset_digest

    damaged = bank.damaged_ingest_parts()
    if damaged:
        # a grown bank is rebuilt by its ingest and every append, in order (`run` refuses a grown bank)
        raise BankError(f"{bank.path}: the ingested dataset is damaged ({damaged[0]} is missing or altered"
                        + (f", and {len(damaged) - 1} more" if len(damaged) > 1 else "") + "); "
                        + bank.reingest_advice())
    digests = sorted(f"{t}:{bank.part_digest(t, p)}" for t in INGEST_TABLES for p in (bank.ingest_parts() or [])
                     if bank.has_part(t, p))
    # the parts' bytes are the data: a re-ingest that writes the same bytes (another slot, data.strict
    # changed on a clean file) changes nothing downstream
    return short_hash([digests, dataset_digest(bank.manifest.get("datasets") or [])], 12)


def refuse_grown_bank(cfg: MemgasConfig, bank: Bank | None = None) -> None:
    """`memgas run` ingests ``data.path`` into its bank (``cfg.bank_path`` unless ``bank`` is given),
    replacing what the bank holds. A bank grown by ``memgas ingest --append`` holds data no config names:
    re-ingesting would delete the appended sessions and questions, so `run` refuses it, naming
    the commands that use it as it is. No bank there yet: nothing to refuse."""
    from memgas.pipeline.append import ingest_history

    if bank is None:
        try:
            bank = Bank(cfg.bank_path)
        except BankError:
            return
    history = ingest_history(bank.manifest.get("datasets") or [])
    appends = history[1:]
    if not appends:
        return
    names = ", ".join(Path(str(d.get("path"))).name for d in appends)
    raise BankError(f"{bank.path}: the bank holds {Path(str(history[0].get('path'))).name} and "
                    f"{len(appends)} appended file{'s' if len(appends) > 1 else ''} ({names}); memgas run would "
                    f"re-ingest {cfg.data.path} and lose what was appended: use the grown bank with `memgas index "
                    f"{bank.path} --config CONFIG` then `memgas answer {bank.path} --config CONFIG`, or set bank_dir "
                    "to a new directory")

"""The ingested dataset: the pipeline's source (held by the bank, verified by the runner, never run by it)."""

from __future__ import annotations

from typing import Any

from memgas.jobs.dataset import ingest_output, refuse_grown_bank
from memgas.jobs.stage import Source, StageContext, Table, short_hash
from memgas.pipeline.bank import INGEST_TABLES

__all__ = ["IngestSource", "ingest_output", "refuse_grown_bank"]


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

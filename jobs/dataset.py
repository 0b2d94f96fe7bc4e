"""What the bank's ingested dataset is: its verified digest, and whether ``memgas run`` may re-ingest it (the
pipeline's source, :class:`memgas.jobs.stages.ingest.IngestSource`, and the job call these)."""

from __future__ import annotations

from pathlib import Path

from memgas.jobs.stage import short_hash
from memgas.pipeline.bank import INGEST_TABLES, Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError


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

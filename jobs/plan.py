"""Work plans: the split of a stage into units, fixed on first run and reused on resume.

Why: a resumed run does exactly the units it planned. Encoder vectors do not depend on the units (nor on
batches), but an LLM's padded batches can (in the last bits, and then in a greedy token), so the units of
an LLM stage must not change when half of them are done. The plan is written once (atomically) and removed
when the stage completes; unit part names end in a digest of the unit (tables.name_units), so a plan made
again with other sizes never takes another unit's part for its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from memgas.pipeline.bank import Bank, atomic_write_json

log = logging.getLogger(__name__)


def load_or_make_plan(bank: Bank, stage: str, make: Callable[[], list[Any]]) -> list[Any]:
    path = bank.path / "_plans" / f"{stage}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())["units"]
        except (json.JSONDecodeError, KeyError):  # written atomically, so only a hand-edited file gets here
            log.warning("plan %s unreadable; making a new one", path)
    units = make()
    atomic_write_json(path, {"stage": stage, "units": units})
    return units


def finish_plan(bank: Bank, stage: str) -> None:
    (bank.path / "_plans" / f"{stage}.json").unlink(missing_ok=True)

"""Texts of a stage's units, read from the bank (``texts``) in blocks, and rebuilt where a part was lost."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pyarrow.compute as pc
from memgas.jobs.keys import generation_key
from memgas.jobs.stage import StageContext, short_hash
from memgas.pipeline.bank import Bank

log = logging.getLogger(__name__)


def texts_by_hash(bank: Bank, hashes: list[str]) -> dict[str, str]:
    if not hashes:
        return {}
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sorted(set(hashes))))
    return dict(zip(t["text_hash"].to_pylist(), t["text"].to_pylist()))


class TextBlocks:
    """Texts of a stage's units, read from the bank once per block of consecutive units.

    A filtered read of ``texts`` scans every row group whatever the number of hashes (measured on the
    LongMemEval-S sample: 0.05-0.13 s for 32 to 6,576 hashes), so one read per unit grows with units x bank
    size: at LongMemEval-S scale (~170k texts, ~1 s a scan) that was ~600 scans in generate (units of 32
    sessions) and ~350 in encode, minutes of driver time while the actors wait for input. Units are
    dispatched in order, so a block is read when its first unit is, and dropped when the next block is read;
    a unit dispatched again later (a retry) re-reads its block.
    """

    def __init__(self, units: list[dict[str, Any]], hashes_of: Callable[[dict[str, Any]], list[str]],
                 block_texts: int) -> None:
        self._hashes_of = hashes_of
        self._units = units
        self._block_of: dict[str, int] = {}
        block, filled = 0, 0
        for u in units:
            n = len(hashes_of(u))
            if filled and filled + n > block_texts:
                block, filled = block + 1, 0
            self._block_of[u["part"]] = block
            filled += n
        self._held: tuple[int, dict[str, str]] | None = None
        self.reads = 0

    def get(self, bank: Bank, unit: dict[str, Any]) -> dict[str, str]:
        block = self._block_of.get(unit["part"])
        if block is None:  # not a unit of this run
            return texts_by_hash(bank, self._hashes_of(unit))
        if self._held is None or self._held[0] != block:
            hashes = [h for u in self._units if self._block_of[u["part"]] == block for h in self._hashes_of(u)]
            self._held = (block, texts_by_hash(bank, hashes))
            self.reads += 1
        held = self._held[1]
        return {h: held[h] for h in self._hashes_of(unit) if h in held}


def unit_texts(ctx: StageContext, unit: dict[str, Any], hashes: list[str]) -> dict[str, str]:
    """A unit's texts through the stage's TextBlocks (``ctx.scratch["texts"]``), else one read."""
    blocks = ctx.scratch.get("texts")
    return blocks.get(ctx.bank, unit) if blocks is not None else texts_by_hash(ctx.bank, hashes)


def rederive_texts(ctx: StageContext, wanted: list[str] | None) -> dict[str, str]:
    """Summary, keyword and hybrid texts of this config's generations, written back to ``texts``; returns
    those of ``wanted`` (None: all).

    The generate stage stores them once; when a texts part was lost (deleted as unreadable) they are
    rebuilt from ``generations`` and the session texts rather than failing the encode stage (or, when the
    generate stage rebuilds its damaged output, by it: its units only generate what has no generation)."""
    from memgas.pipeline.generate import derived_texts

    bank = ctx.bank
    model, version = generation_key(ctx)
    gens = bank.read("generations", ["text_hash", "kind", "output"],
                     filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
    sessions = texts_by_hash(bank, sorted(set(gens["text_hash"].to_pylist())))
    derived = derived_texts(gens, sessions)
    got = dict(zip(derived["text_hash"].to_pylist(), derived["text"].to_pylist()))
    found = got if wanted is None else {h: got[h] for h in wanted if h in got}
    if found:
        log.warning("encode: %d texts were missing from 'texts' and were rebuilt from the generations", len(found))
        bank.write_part("texts", f"derived-repair-{short_hash(sorted(found), 8)}", derived)
    return found

"""Facts about the bundled sample, derived once from the raw file (plain json, not our loaders), so tests
compare the loaders' counts with an independent count instead of with numbers copied from a previous run."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_LOCOMO = REPO / "data" / "sample" / "locomo_sample.json"


def _locomo_counts(path: Path) -> dict[str, int]:
    data = json.loads(path.read_text())
    sessions = sum(1 for conv in data for key, turns in conv["conversation"].items()
                   if re.fullmatch(r"session_\d+", key) and turns)
    return {"histories": len(data), "sessions": sessions, "queries": sum(len(conv["qa"]) for conv in data)}


#: {"histories": 2, "sessions": 38, "queries": 304} for the bundled two-conversation LoCoMo sample
SAMPLE_COUNTS: dict[str, int] = _locomo_counts(SAMPLE_LOCOMO)

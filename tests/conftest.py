"""Facts about the bundled sample, derived once from the raw file (plain json, not our loaders), so tests
compare the loaders' counts with an independent count instead of with numbers copied from a previous run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# OpenMP threads (torch's intra-op pool) that wait for work by sleeping, not spinning: the suite runs the
# models next to Ray workers and `memgas` subprocesses on 2 cores, where spinning threads take the cores
# the others need (SmolLM2 answering one question took 45-60 s instead of 11 s on a loaded 2-core machine).
# Set before anything imports torch; subprocesses and Ray workers (OMP_* is forwarded) inherit it. It
# changes scheduling only, never a result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No progress bars, as in the environment the `memgas` subprocesses get (tests/jobs/conftest.py): tqdm reads
# TQDM_* once, when it is imported, so `memgas` run in-process (cli.main) needs it set before that.
os.environ.setdefault("TQDM_DISABLE", "1")

REPO = Path(__file__).resolve().parents[1]
SAMPLE_LOCOMO = REPO / "data" / "sample" / "locomo_sample.json"


def _locomo_counts(path: Path) -> dict[str, int]:
    data = json.loads(path.read_text())
    sessions = sum(1 for conv in data for key, turns in conv["conversation"].items()
                   if re.fullmatch(r"session_\d+", key) and turns)
    return {"histories": len(data), "sessions": sessions, "queries": sum(len(conv["qa"]) for conv in data)}


#: {"histories": 2, "sessions": 38, "queries": 304} for the bundled two-conversation LoCoMo sample
SAMPLE_COUNTS: dict[str, int] = _locomo_counts(SAMPLE_LOCOMO)

"""The run directory: memgas writes only into an empty directory or one it created (its OWNER marker), and
says in RUNNING.json which config a run attempted and why it stopped.

A run directory always describes one run: ``config.yaml``, ``metrics.json``, ``report.md`` and
``manifest.json`` are replaced together at the end of a successful run; while a run is under way (or
after it failed) ``RUNNING.json`` says which config was attempted and why it stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from memgas.jobs.report import PLOT_FILES
from memgas.pipeline.bank import atomic_write_json
from memgas.pipeline.errors import MemgasError
from memgas.pipeline.locks import LOCK
from memgas.pipeline.redact import redact

from memgas import __version__

RUN_MARKER = "RUNNING.json"
RUN_RECORD = "run_record.json"


class IncompleteRun(MemgasError):
    """The run finished its work but some units failed after retries (counted in the report): exit 4."""

    exit_code = 4


# -- run directory: memgas writes only into an empty directory or one it created --------------------------
#: written when memgas claims a run directory (creates it, or finds it empty), never after the fact: the
#: one proof that the directory is memgas's. ``entries`` lists what it created there beyond RUN_FILES.
OWNER = ".memgas-run.json"
#: what a run writes into its directory (and ``--fresh`` removes, with OWNER's entries; nothing else)
RUN_FILES = (RUN_MARKER, RUN_RECORD, "metrics.json", "manifest.json", "config.yaml", "report.md", *PLOT_FILES,
             "results")


def _owner(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / OWNER).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and "memgas_version" in data else None


def _legacy_run_dir(path: Path) -> bool:
    """A finished run of a memgas from before OWNER existed: its run manifest (config, bank, version).
    RUNNING.json alone does not count: an older memgas left it in any directory it was pointed at."""
    try:
        data = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"memgas_version", "config", "bank"} <= data.keys()


def is_run_dir(path: Path) -> bool:
    """A directory memgas made (its OWNER marker), or a finished run of an older memgas."""
    return _owner(path) is not None or _legacy_run_dir(path)


def _own_bank_name(out: Path, bank_dir: Path | None) -> str | None:
    """The name of the command's bank when it is a memgas bank directly inside ``out`` (the default
    layout ``output_dir/bank``, which `memgas ingest` / `index` fill before `answer` writes the run)."""
    if bank_dir is None:
        return None
    bank_dir = Path(bank_dir)
    if bank_dir.parent.resolve() != out.resolve() or not (bank_dir / "manifest.json").is_file():
        return None
    return bank_dir.name


def _foreign(out: Path, bank_dir: Path | None = None) -> list[str]:
    """Names in ``out`` that keep it from being claimed (anything but a lock file and the bank), sorted."""
    keep = {LOCK, _own_bank_name(out, bank_dir)}
    return sorted(c.name for c in out.iterdir() if c.name not in keep)


def check_output_dir(out: Path, *, fresh: bool, bank_dir: Path | None = None) -> None:
    """Refuse output dirs that cannot work or are not memgas's, before any work or write."""
    if str(out) in ("", "."):
        raise MemgasError("output_dir must name a directory for this run (not '' or '.')")
    if out.exists() and not out.is_dir():
        raise MemgasError(f"output_dir {out} exists and is not a directory")
    if out.exists() and not os.access(out, os.W_OK | os.X_OK):
        raise MemgasError(f"output_dir {out} is not writable")
    if bank_dir is not None and Path(bank_dir).resolve() == out.resolve():
        raise MemgasError(f"bank_dir and output_dir are both {out}: a run writes its own manifest.json, which "
                          "would replace the bank's; give the bank its own directory")
    if out.is_dir() and not is_run_dir(out):
        names = _foreign(out, bank_dir)
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            what = "--fresh: refusing to delete it" if fresh else "refusing to write into it"
            raise MemgasError(f"output_dir {out} is not empty ({shown}) and was not created by memgas (no "
                              f"{OWNER}); {what}: choose a new or empty directory")


def claim_run_dir(out: Path, bank_dir: Path | None = None) -> dict[str, Any]:
    """Under the directory's lock: its OWNER marker, written now if memgas may claim it (empty but for the
    lock file and the command's own bank ``bank_dir``, or a finished run of an older memgas), else the
    refusal of :func:`check_output_dir`."""
    marker = _owner(out)
    if marker is not None:
        return marker
    check_output_dir(out, fresh=False, bank_dir=bank_dir)
    entries = ["bank"] if _legacy_run_dir(out) and (out / "bank" / "manifest.json").is_file() else []
    name = _own_bank_name(out, bank_dir)
    if name is not None and name not in entries:
        entries.append(name)
    marker = {"memgas_version": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "entries": entries}
    atomic_write_json(out / OWNER, marker)
    return marker


def record_own_bank(out: Path, bank_path: Path) -> None:
    """A bank that this run is about to create inside its directory is memgas's (``--fresh`` removes it);
    recorded before it exists, so a run killed while ingesting leaves no unlisted directory behind."""
    if bank_path.parent.resolve() != out.resolve() or bank_path.exists():
        return
    marker = _owner(out) or {}
    if bank_path.name not in marker.setdefault("entries", []):
        marker["entries"].append(bank_path.name)
        atomic_write_json(out / OWNER, marker)


def empty_run_dir(out: Path) -> None:
    """``--fresh``: remove what memgas wrote here (RUN_FILES, OWNER's entries, their temp files), nothing
    else: a user's files in a run directory, or a dataset beside it, stay."""
    marker = _owner(out) or {}
    ours = set(RUN_FILES) | {str(e) for e in marker.get("entries", []) if isinstance(e, str) and e and "/" not in e}
    for child in out.iterdir():
        name = child.name
        temp = name.startswith(".") and name.endswith(".tmp") and name[1:].split(".tmp")[0].rsplit(".", 1)[0] in ours
        if name not in ours and not temp:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def mark_failed(out: Path, exc: BaseException) -> None:
    try:
        marker = json.loads((out / RUN_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return
    if isinstance(exc, IncompleteRun):
        marker["status"] = "incomplete"
    else:
        marker["status"] = "failed"
    # redacted: an error may quote a URL with its credentials (RUNNING.json is a file anyone may share)
    marker["error"] = redact(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
    marker["note"] = ("metrics.json, report.md and config.yaml (if present) describe the previous complete run "
                      "in this directory" if not isinstance(exc, IncompleteRun) else
                      "metrics.json and report.md describe this run; some units failed (see report.md)")
    try:
        atomic_write_json(out / RUN_MARKER, marker)
    except OSError:
        pass

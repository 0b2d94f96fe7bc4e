"""Benchmark scripts run in this process at tiny sizes: each script's ``main(argv)`` and what it printed."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (the scripts import each other by file name)."""
    from memgas.jobs.worker_path import installed_packages_first

    # `python -m pytest` puts the repository first on the path, whose kernels/ folder shadows the installed
    # `kernels` that transformers imports: scripts that load a model themselves (not through the job) need this
    installed_packages_first()
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def run_script(name: str, *argv: str) -> tuple[object, str]:
    """``main(argv)`` of ``benchmarks/<name>.py``: its return value and its standard output (shown on failure)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = bench_module(name).main(list(argv))
    except BaseException:
        sys.stdout.write(buf.getvalue())
        raise
    return rc, buf.getvalue()


@pytest.fixture(scope="session")
def run_bench() -> Callable[..., tuple[object, str]]:
    return run_script


@pytest.fixture(scope="session")
def locomo_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/fixtures/locomo_small.json cut to its first three sessions and the questions whose evidence is in
    them: fewer texts to encode where a script takes a LoCoMo file."""
    conv = json.loads((BENCH.parent / "tests" / "fixtures" / "locomo_small.json").read_text())[0]
    keep = {"1", "2", "3"}
    conv["conversation"] = {k: v for k, v in conv["conversation"].items()
                            if not re.match(r"session_\d+", k) or re.match(r"session_(\d+)", k).group(1) in keep}
    conv["qa"] = [q for q in conv["qa"] if all(e.split(":")[0][1:] in keep for e in q["evidence"])]
    path = tmp_path_factory.mktemp("locomo") / "locomo_tiny.json"
    path.write_text(json.dumps([conv]))
    return path

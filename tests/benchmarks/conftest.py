"""Benchmark scripts run in this process at tiny sizes: each script's ``main(argv)`` with its printed output."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module (the scripts import each other by file name)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


@pytest.fixture
def run_bench(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[object, str]]:
    """``run_bench(name, *argv)``: the script's ``main(argv)`` return value and what it printed."""
    def run(name: str, *argv: str) -> tuple[object, str]:
        capsys.readouterr()
        rc = bench_module(name).main(list(argv))
        return rc, capsys.readouterr().out
    return run

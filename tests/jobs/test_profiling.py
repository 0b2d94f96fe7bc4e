"""The profiler's process-tree sampler: what it reports (a child's CPU time, the tree's peak RSS) at the cost
of one walk of the machine's processes every ``TREE_REFRESH_S`` seconds, not one per sample."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from memgas.jobs import profiling
from memgas.jobs.profiling import Profiler

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\ntime.sleep(30)\n"


def test_a_child_started_in_a_stage_counts_and_the_tree_is_walked_once_per_refresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    walks = []
    children = psutil.Process.children

    def counted(self: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
        walks.append(time.monotonic())
        return children(self, recursive=recursive)

    monkeypatch.setattr(psutil.Process, "children", counted)
    monkeypatch.setattr(profiling._TreeSampler.__init__, "__defaults__", (0.01,))  # a sample every 10 ms
    prof = Profiler()
    child = None
    try:
        with prof.stage("burn"):
            child = subprocess.Popen([sys.executable, "-c", BURN])
            deadline = time.monotonic() + 20
            while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.15 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        if child is not None:
            child.kill()
            child.wait()
    stats = prof.stages["burn"]
    # the child started after the stage's first walk: found by the walk that ends the stage, with its CPU time
    assert stats.cpu_s >= 0.15
    assert stats.peak_rss_mb > 0
    # a sample every 10 ms, but a walk at the start, one every TREE_REFRESH_S (2 s) and one at the end
    assert stats.wall_s >= 0.1
    assert len(walks) <= 3 + stats.wall_s / 2.0

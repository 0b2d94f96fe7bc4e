"""Per-stage measurements: wall and CPU time, peak RSS of the whole process tree, items and tokens.

CPU time and RSS are summed over this process and all its descendants (Ray's raylet and workers are
started by the driver, so they are descendants in local mode). On a cluster only the driver's node is
seen; the report says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np
import psutil
from memgas.jobs.placement import local_cuda_devices

log = logging.getLogger(__name__)


#: Seconds between two walks of the process tree (new children found). A walk reads every process of the
#: machine (psutil's parent map) and each child's start time; the samples in between read only the processes
#: found by the last walk (two small /proc reads each).
TREE_REFRESH_S = 2.0


class _Tree:
    """This process and its descendants. ``processes()`` walks the tree at most every ``refresh_s`` seconds
    (and when ``walk=True``) and otherwise returns the processes found last time: the walk (every process of
    the machine) was most of the profiler's cost, sampled four times a second. A process that starts is
    seen at the next walk with all its CPU time since it started; one that lives less than ``refresh_s``
    between two walks may go unseen."""

    def __init__(self, refresh_s: float = TREE_REFRESH_S) -> None:
        self.me = psutil.Process(os.getpid())
        self.refresh_s = refresh_s
        self.known: list[psutil.Process] = [self.me]
        self.walked = -float("inf")

    def processes(self, walk: bool = False) -> list[psutil.Process]:
        now = time.monotonic()
        if walk or now - self.walked >= self.refresh_s:
            self.walked = now
            try:
                children = self.me.children(recursive=True)
            except psutil.Error:
                children = []
            self.known = [self.me, *children]
        return self.known


def gpu_peak_bytes() -> int | None:
    """torch's peak CUDA allocation in this process; None where torch sees no GPU (not imported to be asked
    where no GPU device file exists: :func:`memgas.jobs.placement.local_cuda_devices`)."""
    if local_cuda_devices() == 0:
        return None
    try:
        import torch

        return int(torch.cuda.max_memory_allocated())
    except Exception:  # a CUDA error: not the job's
        return None


@dataclass
class StageStats:
    name: str
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    items: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: int = 0
    skipped: int = 0
    gpu_peak_mb: float | None = None
    latencies_ms: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["items_per_s"] = round(self.items_per_s, 3)
        d["tokens_per_s"] = round((self.tokens + self.prompt_tokens + self.completion_tokens) / self.wall_s, 3) if self.wall_s > 0 else 0.0
        return d


def _tree_snapshot(tree: _Tree, walk: bool = False) -> tuple[int, dict[int, float]]:
    """(RSS of the process tree, CPU seconds per pid)."""
    rss, cpu = 0, {}
    for p in tree.processes(walk):
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return rss, cpu


class _TreeSampler(threading.Thread):
    """Samples the process tree: peak RSS, and CPU time per pid as last seen.

    Why per pid: a model actor started and killed within a stage is gone when the stage ends; its CPU
    time counts up to the last sample (every ``interval`` seconds) instead of vanishing.
    """

    def __init__(self, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval, self._stop_evt = interval, threading.Event()
        self.tree = _Tree()
        self.peak, self.start_cpu = _tree_snapshot(self.tree, walk=True)
        self.last_cpu = dict(self.start_cpu)

    def _sample(self, walk: bool = False) -> None:
        rss, cpu = _tree_snapshot(self.tree, walk)
        self.peak = max(self.peak, rss)
        self.last_cpu.update(cpu)

    def run(self) -> None:
        while not self._stop_evt.wait(self.interval):
            self._sample()

    def stop(self) -> tuple[int, float]:
        self._stop_evt.set()
        self.join(timeout=2)
        self._sample(walk=True)  # the processes started since the last walk count too
        cpu = sum(max(0.0, t - self.start_cpu.get(pid, 0.0)) for pid, t in self.last_cpu.items())
        return self.peak, cpu


class Profiler:
    """Collects :class:`StageStats` for the stages of one job, in order."""

    def __init__(self) -> None:
        self.stages: dict[str, StageStats] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[StageStats]:
        stats = self.stages.setdefault(name, StageStats(name))
        sampler = _TreeSampler()
        sampler.start()
        t0 = time.perf_counter()
        log.info("stage %s: start", name)
        try:
            yield stats
        finally:
            stats.wall_s += time.perf_counter() - t0
            peak, cpu = sampler.stop()
            stats.cpu_s += cpu
            stats.peak_rss_mb = max(stats.peak_rss_mb, peak / 2**20)
            gpu = gpu_peak_bytes()
            if gpu is not None:
                stats.gpu_peak_mb = gpu / 2**20
            log.info("stage %s: %.1fs, %d items", name, stats.wall_s, stats.items)

    def to_dict(self) -> dict[str, dict]:
        return {k: v.to_dict() for k, v in self.stages.items()}


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    """p50/p95/mean of latencies given in seconds, in milliseconds."""
    if not samples_s:
        return {}
    a = np.asarray(samples_s) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)), "mean_ms": float(a.mean()), "n": int(a.size)}

"""The job's Ray session: a local Ray starts in the background while the driver works, every use of Ray waits
for it, a start that fails is raised where Ray is first used, and the shutdown does not wait out the grace
Ray gives its autoscaler monitor."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from memgas.jobs import executor, ray_limits, ray_session, runner, tables
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import Report, StageContext
from memgas.pipeline import schema
from memgas.pipeline.association.blocks import NodeBlocks
from memgas.pipeline.errors import ResourceLimit

from .test_toy_stage import PIPELINE, TOY, ToyStage, bank_cfg  # noqa: F401 - bank_cfg is a fixture


class SharedToy(ToyStage):
    """The toy stage with a block shared through the executor in every payload (as node blocks are)."""

    name = "toy-shared"
    writes = (tables.Table("toy_shared", "fingerprint"),)

    def inputs(self, ctx: StageContext, unit: dict) -> dict:
        block = executor.share(np.full((1 << 12, 64), len(unit["sessions"]), np.float32))
        return {**super().inputs(ctx, unit), "block": NodeBlocks([block], 1 << 12, 1 << 12, 64, keep=self,
                                                                 fetch=executor.fetch)}

    @staticmethod
    def run(model: None, payload: dict, params: dict) -> dict:
        block = payload["block"][0:2]
        assert block[0, 0] == len(payload["rows"])
        return {"toy_shared": ToyStage.run(model, payload, params)["toy_counts"]}

    def finish(self, ctx: StageContext) -> dict:
        return {"rows": len(tables.current_parts(ctx, "toy_shared"))}


def _start_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ray-start" and t.is_alive()]


@pytest.mark.slow
def test_ray_starts_in_the_background_and_stops_without_the_monitors_grace(monkeypatch, bank_cfg) -> None:
    """begin_ray returns before Ray is up, the first stage's tasks wait for it (from the main thread: the
    processes' parent thread lives on), the caller's SIGTERM handler stays, and the shutdown kills the monitor
    at once: Ray's own SIGTERM left it reporting to the GCS already gone until its 1 s grace ran out."""
    timed_out: list[int] = []
    real_wait = subprocess.Popen.wait

    def wait(self: subprocess.Popen, timeout: float | None = None) -> int:
        try:
            return real_wait(self, timeout)
        except subprocess.TimeoutExpired:
            timed_out.append(self.pid)
            raise

    def handler(signum: int, frame: object) -> None:  # pragma: no cover - never called
        pass

    monkeypatch.setattr(subprocess.Popen, "wait", wait)
    monkeypatch.setitem(schema.TABLES, "toy_shared", TOY)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        t0 = time.perf_counter()
        ray_session.begin_ray(None, num_cpus=1)
        began = time.perf_counter() - t0
        assert ray_session.ray_running() and len(_start_threads()) == 1
        assert signal.getsignal(signal.SIGTERM) is handler
        # a stage's tasks wait for the start (timed apart from the stage's own work) and write what they
        # write in-process
        bank, cfg = bank_cfg
        prof = Profiler()
        (entry,) = runner.run_stages(StageContext(cfg, bank, None, use_ray=True), ["toy"], prof, pipeline=PIPELINE)
        ray = ray_session.ray_module()
        assert ray.is_initialized() and began < (time.perf_counter() - t0) / 2
        assert entry["status"] == "executed" and prof.stages["toy"].extra["ray_start_wait_s"] > 0
        sessions = bank.read("sessions", ["session_id", "position"]).sort_by("session_id").to_pylist()
        assert bank.read("toy_counts").sort_by("session_id").to_pylist() == [{**r, "seed": cfg.seed} for r in sessions]
        assert ray_session.init_ray(None, num_cpus=1) == "already-initialized"
        from ray._private import ray_constants, worker

        processes = worker._global_node.all_processes
        monitor = [i.process.pid for i in processes[ray_constants.PROCESS_TYPE_MONITOR]]
        everything = [i.process for infos in processes.values() for i in infos]
        # a slice whose steps left are the driver's gives Ray back before them (the answer's report and its
        # latency probe get the memory), once, and after the last step that may run on Ray
        events: list[tuple[str, bool]] = []

        class Look(Report):
            name = "look"

            def report(self, ctx: StageContext) -> dict:
                events.append(("look", ray.is_initialized() or any(p.poll() is None for p in everything)))
                return {}

        def release() -> None:
            events.append(("release", ray.is_initialized()))
            ray_session.shutdown_ray()

        # a stage ends holding no reference to what its payloads shared (its blocks would stay in the object
        # store through the stages after it: a reference cycle kept them until a full collection)
        core = worker.global_worker.core_worker
        before = set(core.get_all_reference_counts())
        ctx = StageContext(cfg, bank, None, use_ray=True)
        (entry,) = runner.run_stages(ctx, ["toy-shared"], Profiler(), pipeline=(*PIPELINE, SharedToy()))
        assert entry["status"] == "executed" and entry["units_done"] > 1
        assert set(core.get_all_reference_counts()) <= before
        ctx = StageContext(cfg, bank, None, use_ray=True)
        record = runner.run_stages(ctx, ["toy", "look"], Profiler(), pipeline=(*PIPELINE, Look()), release_ray=release)
        assert [e["status"] for e in record] == ["skipped", "executed"]
        assert events == [("release", True), ("look", False)] and not ctx.use_ray
        assert monitor and not set(monitor) & set(timed_out)
        assert not ray.is_initialized() and all(p.poll() is not None for p in everything)
        assert not _start_threads() and not ray_session.ray_running()
    finally:
        ray_session.shutdown_ray()
        signal.signal(signal.SIGTERM, previous)


def test_a_start_that_fails_is_raised_at_every_use_until_shutdown(monkeypatch) -> None:
    """The start's error (here: Ray failing under a finite `ulimit -v`, named as that limit) reaches the first
    use of Ray, and every later one: none may fall through to Ray's auto-start of a default instance."""
    import ray

    def fail(**kwargs: object) -> None:
        raise RuntimeError("the raylet did not come up")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", fail)
    monkeypatch.setattr(ray_limits.resource, "getrlimit", lambda which: (8 << 30, 8 << 30))
    try:
        ray_session.begin_ray(None, num_cpus=1)
        for _ in range(2):
            with pytest.raises(ResourceLimit, match="address-space limit of 8192 MiB"):
                ray_session.ray_module()
    finally:
        ray_session.shutdown_ray()
    assert not _start_threads() and ray_session.wait_for_ray() is None

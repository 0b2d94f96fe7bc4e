"""Execution of a stage's units: Ray tasks, Ray actors holding a model, or in-process; all checkpointed.

Every unit has a deterministic part name; a unit whose part of the stage's first table is already complete
is skipped, so a killed job resumes where it stopped. The driver reads each unit's inputs from the bank
(``stage.inputs``), ships them with the call (Ray puts large arguments in the object store) and writes the
returned Arrow tables itself: workers never open the bank, so a cluster needs no shared filesystem, and
there is one writer per bank. Inputs are materialised just before submission, with a bounded number of
units in flight, so the driver's memory does not grow with the split.

Failures: a task that raises fails the stage with one line (completed units are kept). A model actor that
dies (Ray's OOM killer, a segfault in a native library) is replaced and its unit re-run, at most
``ACTOR_RETRIES`` times; an exception raised by the stage's own code is not retried (it would fail again).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from memgas.jobs.placement import Placement, local_cuda_devices, placement
from memgas.jobs.ray_session import ray_module, wait_for_ray
from memgas.jobs.stage import Active, Stage, StageContext, short_hash
from memgas.pipeline import faults
from memgas.pipeline.bank import Bank, key_order
from memgas.pipeline.errors import Bug, EnvironmentFailure, MemgasError, is_environmental
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

#: How often a unit is re-run on a fresh actor after its actor died.
ACTOR_RETRIES = 2


def resolve(path: str) -> Any:
    """``"package.module:name"`` -> the object (so Ray ships a name, not a closure)."""
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in name.split("."):
        obj = getattr(obj, attr)
    return obj


# -- values shared with tasks -------------------------------------------------------------------------
# Stages and the history index hand the executor plain values and get back opaque references (Ray's
# ObjectRefs, which Ray counts while a payload holds them); a task turns one back into its value with
# :func:`fetch` where it reads it. Ray is imported only here, in ``ray_session`` (its start and shutdown) and in
# ``placement`` (tests/test_package_shape.py).
def share(value: Any) -> Any:
    """An opaque reference to ``value`` that tasks read with :func:`fetch`: put into Ray's object store once,
    so that every unit whose payload holds the reference shares one copy (zero-copy for arrays)."""
    ray = ray_module()  # after a start under way (ray_session.begin_ray)
    return ray.put(value)


def fetch(handle: Any) -> Any:
    """The value of a reference :func:`share` made; any other value as it is (a handle read in place). A
    module-level function: payloads carry it by name (``NodeBlocks.fetch``). Ray is not imported here: a
    reference can only have been unpickled where it already was (an in-process run never imports it)."""
    ray = sys.modules.get("ray")
    return ray.get(handle) if ray is not None and isinstance(handle, ray.ObjectRef) else handle


#: what to change when no node has the GPUs a kernel task / a model actor asks for (:func:`require_gpus`;
#: the job's pre-flight asks the same before the first stage, memgas.jobs.preflight.check_cluster)
TASK_GPU_HINT = "set retrieval.device=cpu (or auto), or ray.num_gpus_per_task to what one node has"
ACTOR_GPU_HINT = ("set ray.num_gpus_per_model_actor=0 with encoder.device=cpu (or auto) and a CPU LLM backend, "
                  "or start GPU nodes")


def require_gpus(what: str, per_worker: float, hint: str) -> None:
    """Fail fast (exit 3, one line) when no live node of the cluster has ``per_worker`` GPUs.

    Ray queues a request no node can meet and waits forever (its autoscaler only prints "No available node
    types can fulfill resource request" every 35 s), so a GPU request is checked against the nodes that are
    up before any actor or task asks for it. An autoscaling cluster must have its GPU nodes up first."""
    if per_worker <= 0:
        return
    ray = ray_module()
    largest = max((float(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")), default=0.0)
    if largest >= per_worker:
        return
    total = float(ray.cluster_resources().get("GPU", 0))
    raise EnvironmentFailure(
        f"{what} needs {per_worker:g} GPU per worker but the Ray cluster has {total:g} GPUs (at most {largest:g} "
        f"on one node); {hint}")


# -- model hosts ------------------------------------------------------------------------------------
class ModelHost:
    """Holds one loaded model (built by :func:`memgas.jobs.models.make_model`) inside a Ray actor or in-process."""

    def __init__(self, kind: str, config: dict) -> None:
        from memgas.jobs.models import make_model

        self.model = make_model(kind, config)

    def load(self, kind: str, config: dict) -> None:
        """Drop the model this host holds and load another (:meth:`ActorPool.reuse_for`: a CPU actor serves the
        next stage instead of a fresh process). The old model and every cached LLM are released first, so the
        process holds one model at a time, as a fresh actor would; torch's threads are set again by
        ``make_model``, so the new model computes exactly as in a fresh process."""
        import gc

        from memgas.jobs.models import make_model
        from memgas.pipeline.models.llms import release_cached_models

        self.model = None
        release_cached_models()
        gc.collect()
        self.model = make_model(kind, config)

    def call(self, fn_path: str, payload: Any, params: dict) -> dict[str, pa.Table]:
        faults.hit(f"actor-call:{type(self.model).__name__}")
        return resolve(fn_path)(self.model, payload, params)

    def torch_threads(self) -> int:
        """torch's intra-op threads in this process (what ``make_model`` set from the stage's config)."""
        import torch

        return torch.get_num_threads()

    def gpu_peak_mb(self, reset: bool = True) -> float | None:
        """Peak GPU memory of *this actor process* since the last reset: torch's allocator peak plus the peak
        of CuPy's pool (tracked by ``kernels.backend``). Not the device: vLLM V1 runs the model in its own
        engine process, whose memory this figure does not include (see :meth:`gpu_memory`)."""
        total, seen = 0.0, False
        if local_cuda_devices():  # torch is imported only where it may see a GPU (an LLM-free actor has none)
            import torch

            total += torch.cuda.max_memory_allocated() / 2**20
            seen = True
            if reset:
                torch.cuda.reset_peak_memory_stats()
        from memgas.kernels.backend import cupy_pool_peak_mb

        pool = cupy_pool_peak_mb(reset=reset)
        if pool is not None:
            total += pool
            seen = True
        return total if seen else None

    def gpu_memory(self) -> dict[str, Any] | None:
        """What the report shows for this actor's GPU memory: the process peak (:meth:`gpu_peak_mb`), and for
        a model that runs in another process (vLLM's engine) the memory used on the device as CUDA reports it
        now (every process on that GPU), with the figure's scope spelled out."""
        peak = self.gpu_peak_mb()
        if peak is None:
            return None
        out: dict[str, Any] = {"process_peak_mb": peak, "scope": "actor process only"}
        if getattr(getattr(self.model, "llm", self.model), "engine_in_other_process", False):
            try:
                import torch

                free, total = torch.cuda.mem_get_info()
                out["device_used_mb"] = (total - free) / 2**20
                out["scope"] = "actor process only; vLLM's engine process is in device_used_mb (whole GPU, now)"
            except Exception:  # informative only
                pass
        return out


def run_task(fn_path: str, payload: Any, params: dict) -> dict[str, pa.Table]:
    """A task stage's ``run`` on a payload the driver prepared (what Ray executes on any node)."""
    return resolve(fn_path)(None, payload, params)


#: In-process hosts by (kind, config): repeated in-process runs (tests, --no-ray) load a model once.
_LOCAL_HOSTS: dict[str, ModelHost] = {}


def _local_host(kind: str, config: dict) -> ModelHost:
    key = short_hash([kind, config], 12)
    if key not in _LOCAL_HOSTS:
        while len(_LOCAL_HOSTS) >= 3:  # bound memory: at most three hosts (generator, encoder, reader)
            _LOCAL_HOSTS.pop(next(iter(_LOCAL_HOSTS)))
        _LOCAL_HOSTS[key] = ModelHost(kind, config)
    return _LOCAL_HOSTS[key]


def use_loaded_model(kind: str, config: dict, model: Any) -> None:
    """In-process runs use ``model`` (already loaded) wherever a stage asks for ``(kind, config)``: for
    tests that wrap a real model, and for embedding memgas in a process that holds the model already."""
    key = short_hash([kind, config], 12)
    host = ModelHost.__new__(ModelHost)
    host.model = model
    _LOCAL_HOSTS[key] = host


class ActorPool:
    """Ray actors holding one model config; reused by consecutive stages with the same model (the judge
    reuses the reader's engine), given the next stage's model on CPUs (:meth:`reuse_for`), and killed when
    the runner reaches a stage that needs the CPUs for tasks, or ends."""

    def __init__(self, kind: str, config: dict, n: int, num_cpus: float, num_gpus: float) -> None:
        ray = ray_module()
        self.key = short_hash([kind, config, num_gpus], 12)
        self.num_gpus = num_gpus
        self._cls = ray.remote(ModelHost).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0)
        self._args = (kind, config)
        self.actors = [self._cls.remote(*self._args) for _ in range(max(1, n))]

    def reuse_for(self, kind: str, config: dict, n: int) -> bool:
        """Load another model into this pool's CPU actors (:meth:`ModelHost.load`), keeping ``n`` of them
        (more are started, extras killed): a stage after another actor stage then skips the process start
        and imports (several seconds of CPU per actor) that fresh actors pay. Not on GPUs, where a fresh
        process is the only sure way to give the device memory back (vLLM's engine, CUDA contexts).
        False where the pool cannot be reused: then the caller closes it and starts fresh actors, so a model
        that fails to load fails the way it always has."""
        ray = ray_module()
        if self.num_gpus:
            return False
        n = max(1, n)
        keep, extra = self.actors[:n], self.actors[n:]
        for a in extra:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        self.actors = keep
        try:
            ray.get([a.load.remote(kind, config) for a in keep])
        except Exception as exc:  # a dead actor or a failed load: the caller starts fresh ones
            log.debug("reusing the actors for %s failed (%s); starting fresh ones", kind, _one_line(exc))
            return False
        self.key = short_hash([kind, config, self.num_gpus], 12)
        self._args = (kind, config)
        self.actors = keep + [self._cls.remote(*self._args) for _ in range(n - len(keep))]
        return True

    def replace(self, dead: Any) -> Any:
        ray = ray_module()
        try:
            ray.kill(dead)
        except Exception:  # already gone
            pass
        fresh = self._cls.remote(*self._args)
        self.actors = [fresh if a is dead else a for a in self.actors]
        return fresh

    def gpu_memory(self) -> dict[str, Any] | None:
        """The largest figures over the pool's actors (:meth:`ModelHost.gpu_memory`)."""
        ray = ray_module()
        vals = [v for v in ray.get([a.gpu_memory.remote() for a in self.actors]) if v is not None]
        if not vals:
            return None
        out = max(vals, key=lambda v: v["process_peak_mb"])
        used = [v["device_used_mb"] for v in vals if "device_used_mb" in v]
        return {**out, **({"device_used_mb": max(used)} if used else {})}

    def close(self) -> None:
        ray = ray_module()
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        self.actors = []


# -- the executor -------------------------------------------------------------------------------------
def release_unused_memory() -> None:
    """Give back to the OS what Arrow's memory pool (mimalloc) freed but keeps: a filtered read decodes every
    row group of a table to keep a few rows (a unit's vectors out of all of ``embeddings``), and the driver
    kept ~0.7 GB of freed pages per card-graph unit at 60 histories, more as the bank grows. Microseconds."""
    pa.default_memory_pool().release_unused()


def _write(store: Bank, stage: Stage, part: str, tables: dict[str, pa.Table]) -> None:
    """Write a unit's tables (bank table -> rows); the first declared table's part last, so it doubles as
    the unit's completion marker."""
    check = stage.writes[0].physical
    if check not in tables:
        raise MemgasError(f"{stage.name}: unit {part} returned no {check!r} table")
    if stage.writes[0].store == "results":  # a run's results in one row order, whatever the order of the input files
        tables = {name: key_order(name, t) for name, t in tables.items()}
    for name, t in tables.items():
        if name != check:
            store.write_part(name, part, t)
    store.write_part(check, part, tables[check])
    faults.hit(f"{stage.name}:unit-done")


def _done(store: Bank, stage: Stage, unit: dict, tables: dict[str, pa.Table], t0: float, counts: dict, bar: Any) -> None:
    """A unit's result: write it (marker last) and count it."""
    size = int(unit.get("size", 1))
    counts["unit_seconds"].append((size, time.perf_counter() - t0))
    _write(store, stage, unit["part"], tables)
    release_unused_memory()
    counts["done"] += 1
    counts["items"] += size
    bar.update(size)


def _failed(stage: Stage, unit: dict, exc: BaseException, how: str = "failed") -> MemgasError:
    cause = getattr(exc, "cause", None) or exc  # a task's own exception inside Ray's RayTaskError
    if not is_environmental(cause):  # the same input fails the same way: a re-run would not help
        return Bug(f"{stage.name}: unit {unit['part']} {how} from a bug: {_one_line(cause)} (a re-run fails the "
                   "same way; re-run with -v for the traceback)")
    return MemgasError(f"{stage.name}: unit {unit['part']} {how}: {_one_line(exc)}. Completed units are kept; "
                       "re-run to resume.")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def execute_units(stage: Stage, ctx: StageContext, active: Active, units: Sequence[dict[str, Any]], store: Bank, *,
                  pools: dict[str, ActorPool], desc: str | None = None) -> dict[str, Any]:
    """Run every unit of ``units`` not yet complete in ``store``.

    Driver stages run in this process, task stages as Ray tasks (in-process without Ray), actor stages on
    actors holding their model (:func:`memgas.jobs.placement.placement`). Before the first ``inputs`` the
    units about to run are in ``ctx.units`` (in dispatch order: a stage may batch their reads).
    Returns counts: ``done`` (this run), ``skipped`` (complete before), ``items``, ``unit_seconds``
    (per unit: (items, seconds) as submitted to result), ``retries`` (units re-run on a fresh actor),
    ``gpu_memory`` (actor stages: :meth:`ModelHost.gpu_memory`, else None) and, under Ray, ``ray_start_wait_s``
    (the seconds this stage waited for a Ray start begun in the background: the first Ray stage's share of it).
    """
    check = stage.writes[0].physical
    todo = [u for u in units if not store.has_part(check, u["part"])]
    counts: dict[str, Any] = {"done": 0, "skipped": len(units) - len(todo), "items": 0, "unit_seconds": [],
                              "retries": 0, "gpu_memory": None}
    if not todo:
        return counts
    ctx.units = todo
    fn = stage_fn(stage)
    params = active.params
    if ctx.use_ray and stage.where != "driver":  # the rest of a start begun in the background, timed apart
        t0 = time.perf_counter()
        wait_for_ray()
        counts["ray_start_wait_s"] = time.perf_counter() - t0
    place = placement(stage, active, ctx)
    bar = tqdm(total=sum(int(u.get("size", 1)) for u in todo), desc=desc or stage.name, unit="item", leave=False)
    try:
        if not ctx.use_ray or stage.where == "driver":
            host = _local_host(stage.model, place.config) if stage.where == "actor" else None
            for u in todo:
                t0 = time.perf_counter()
                payload = stage.inputs(ctx, u)
                out = host.call(fn, payload, params) if host else run_task(fn, payload, params)
                del payload  # not alive beside the next unit's
                _done(store, stage, u, out, t0, counts, bar)
            if host is not None:
                counts["gpu_memory"] = host.gpu_memory()
            return counts
        if stage.where == "actor":
            _run_on_actors(stage, ctx, place, todo, fn, params, pools, counts, bar, store)
        else:
            _run_as_tasks(stage, ctx, place, todo, fn, params, counts, bar, store)
        return counts
    finally:
        bar.close()


def stage_fn(stage: Stage) -> str:
    """The importable name of a stage's ``run`` (what a worker resolves)."""
    return f"{type(stage).__module__}:{type(stage).__name__}.run"


def task_options(num_gpus: float) -> dict[str, Any]:
    """``ray.remote`` options of a task stage's units. A GPU task runs in a fresh worker (``max_calls=1``): a
    reused worker keeps the CUDA context and CuPy pool of the GPU its first task was given, so a later task
    assigned another GPU would still run on the first. Ray applies that default only to the decorator form,
    and ``.options()`` cannot set ``max_calls`` at all, so the options go to ``ray.remote(**options)``."""
    opts: dict[str, Any] = {"num_cpus": 1, "num_gpus": num_gpus, "max_retries": 2}
    if num_gpus > 0:
        opts["max_calls"] = 1
    return opts


def _run_as_tasks(stage, ctx, place, todo, fn, params, counts, bar, store) -> None:
    ray = ray_module()
    require_gpus(f"stage {stage.name}", place.gpus, TASK_GPU_HINT)
    remote = ray.remote(**task_options(place.gpus))(run_task)
    params_ref = ray.put(params)
    limit = max(2, int(ray.available_resources().get("CPU", 1)) * 2)
    queue = list(todo)
    pending: dict[Any, tuple[dict, float]] = {}
    try:
        while queue or pending:
            while queue and len(pending) < limit:
                u = queue.pop(0)
                pending[remote.remote(fn, stage.inputs(ctx, u), params_ref)] = (u, time.perf_counter())
                release_unused_memory()  # the payload is in Ray's object store: what reading it freed goes
            ready, _ = ray.wait(list(pending), num_returns=1)
            u, t0 = pending.pop(ready[0])
            try:
                tables = ray.get(ready[0])
            except Exception as exc:  # the step raised, or its worker crashed past Ray's retries
                raise _failed(stage, u, exc) from exc
            _done(store, stage, u, tables, t0, counts, bar)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def _run_on_actors(stage, ctx, place, todo, fn, params, pools, counts, bar, store) -> None:
    ray = ray_module()
    from ray.exceptions import (
        ActorDiedError,
        ActorUnavailableError,
        OutOfMemoryError,
        RayActorError,
    )

    died = (RayActorError, ActorDiedError, ActorUnavailableError, OutOfMemoryError)
    pool = _pool_for(stage, place, pools, len(todo))
    params_ref = ray.put(params)
    queue = [(u, 0) for u in todo]
    free = list(pool.actors)
    pending: dict[Any, tuple[dict, int, Any, float]] = {}
    while queue or pending:
        while queue and free:
            (u, attempt), actor = queue.pop(0), free.pop()
            pending[actor.call.remote(fn, stage.inputs(ctx, u), params_ref)] = (u, attempt, actor, time.perf_counter())
            release_unused_memory()
        ready, _ = ray.wait(list(pending), num_returns=1)
        u, attempt, actor, t0 = pending.pop(ready[0])
        try:
            tables = ray.get(ready[0])
        except died as exc:
            if attempt >= ACTOR_RETRIES:
                raise _failed(stage, u, exc, f"failed {attempt + 1} times on a fresh actor") from exc
            log.warning("%s: actor died on unit %s (%s); retrying on a fresh actor", stage.name, u["part"],
                        _one_line(exc))
            counts["retries"] += 1
            free.append(pool.replace(actor))
            queue.insert(0, (u, attempt + 1))
            continue
        except Exception as exc:
            raise _failed(stage, u, exc) from exc
        _done(store, stage, u, tables, t0, counts, bar)
        free.append(actor)
    try:
        counts["gpu_memory"] = pool.gpu_memory()
    except Exception as exc:  # informative only
        log.debug("gpu memory probe failed: %s", exc)


def _pool_for(stage: Stage, place: Placement, pools: dict[str, ActorPool], n_units: int) -> ActorPool:
    """The actor pool for the stage's model: the open one if it holds the same model; on CPUs the open one
    with this model loaded into its actors (:meth:`ActorPool.reuse_for`); else fresh actors. GPUs per actor
    are checked against the cluster before any actor is created (:func:`require_gpus`)."""
    key = short_hash([stage.model, place.config, place.gpus], 12)
    open_pool = pools.get("current")
    if open_pool is not None and open_pool.key == key:
        return open_pool
    n = min(place.actors, n_units)
    if open_pool is not None and not place.gpus and open_pool.reuse_for(stage.model, place.config, n):
        return open_pool
    if open_pool is not None:
        open_pool.close()
        pools.pop("current")
    require_gpus(f"stage {stage.name} ({stage.model} actors)", place.gpus, ACTOR_GPU_HINT)
    pool = ActorPool(stage.model, place.config, n, num_cpus=1, num_gpus=place.gpus)
    pools["current"] = pool
    return pool

"""Ray execution: sharded CPU tasks and model actors, both checkpointed as bank parts.

Steps are plain functions (datatrove's step/executor split): ``fn(payload) -> pa.Table``. The executor
decides where they run. Every unit of work has a deterministic part name; a unit whose part is already
complete in the bank is skipped, so a killed job resumes where it stopped. Results come back to the driver
as Arrow tables and the driver writes them (one writer per bank: no locking needed, and workers on a
cluster need no access to the bank's filesystem).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import MemgasError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkUnit:
    """One checkpointed unit: its output part name and the payload its function receives."""

    part: str
    payload: Any
    size: int = 1  # items, for progress bars


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """Connect to a cluster (``address`` or RAY_ADDRESS) or start a local embedded Ray."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return "already-initialized"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
        return f"cluster:{address}"
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        # children inherit the driver's environment (offline HF flags, thread caps)
        runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_", "OMP_", "MKL_", "TOKENIZERS_"))}},
    )
    return f"local:{ray.available_resources().get('CPU', 0):.0f}cpu"


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def resolve(path: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (so Ray ships a name, not a closure)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _call(fn_path: str, payload: Any, context: dict) -> pa.Table:
    return resolve(fn_path)(payload, context)


def run_tasks(
    bank: Bank,
    table: str,
    units: Sequence[WorkUnit],
    fn_path: str,
    context: dict,
    *,
    desc: str,
    dim: int | None = None,
    num_cpus: float = 1,
    max_retries: int = 2,
    use_ray: bool = True,
) -> dict[str, int]:
    """Run ``fn(payload, context) -> Arrow table`` for every unit not yet complete in ``bank``.

    Returns counts: done (this run), skipped (already complete), items.
    """
    todo = [u for u in units if not bank.has_part(table, u.part)]
    counts = {"done": 0, "skipped": len(units) - len(todo), "items": 0}
    if not todo:
        return counts
    bar = tqdm(total=sum(u.size for u in todo), desc=desc, unit="item", leave=False)
    try:
        if not use_ray:
            for u in todo:
                bank.write_part(table, u.part, _call(fn_path, u.payload, context), dim=dim)
                counts["done"] += 1
                counts["items"] += u.size
                bar.update(u.size)
            return counts
        import ray

        remote = ray.remote(_call).options(num_cpus=num_cpus, max_retries=max_retries)
        ctx_ref = ray.put(context)
        pending = {remote.remote(fn_path, u.payload, ctx_ref): u for u in todo}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            unit = pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except Exception as exc:  # a crashed worker after its retries, or an error in the step
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise MemgasError(
                    f"{desc}: unit {unit.part} failed after {max_retries} retries: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[-1] if str(exc) else ''}. Completed units are kept; re-run to resume."
                ) from exc
            bank.write_part(table, unit.part, result, dim=dim)
            counts["done"] += 1
            counts["items"] += unit.size
            bar.update(unit.size)
        return counts
    finally:
        bar.close()


class _ActorHost:
    """Holds one worker object (a model loaded once) inside a Ray actor or in-process."""

    def __init__(self, factory_path: str, config: dict) -> None:
        self.worker = resolve(factory_path)(config)

    def call(self, method: str, payload: Any) -> Any:
        return getattr(self.worker, method)(payload)


def run_actor_units(
    bank: Bank,
    outputs: Callable[[Any], dict[str, pa.Table]],
    units: Sequence[WorkUnit],
    factory_path: str,
    config: dict,
    method: str,
    *,
    desc: str,
    check_table: str,
    n_actors: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    dims: dict[str, int] | None = None,
    use_ray: bool = True,
) -> dict[str, int]:
    """Send each unit not yet complete (judged by ``check_table``'s part) to a model actor.

    The actor's result is split by ``outputs(result) -> {table: arrow_table}``; the ``check_table`` part
    is written last, so it doubles as the unit's completion marker.
    """
    todo = [u for u in units if not bank.has_part(check_table, u.part)]
    counts: dict[str, Any] = {"done": 0, "skipped": len(units) - len(todo), "items": 0, "unit_seconds": []}
    if not todo:
        return counts
    dims = dims or {}

    def write(unit: WorkUnit, result: Any) -> None:
        tables = outputs(result)
        for name, t in tables.items():
            if name != check_table:
                bank.write_part(name, unit.part, t, dim=dims.get(name))
        bank.write_part(check_table, unit.part, tables[check_table], dim=dims.get(check_table))
        counts["done"] += 1
        counts["items"] += unit.size

    bar = tqdm(total=sum(u.size for u in todo), desc=desc, unit="item", leave=False)
    try:
        if not use_ray:
            host = _ActorHost(factory_path, config)
            for u in todo:
                t0 = time.perf_counter()
                result = host.call(method, u.payload)
                counts["unit_seconds"].append((u.size, time.perf_counter() - t0))
                write(u, result)
                bar.update(u.size)
            return counts
        import ray

        Actor = ray.remote(_ActorHost).options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=1, max_task_retries=1)
        actors = [Actor.remote(factory_path, config) for _ in range(max(1, min(n_actors, len(todo))))]
        queue = list(todo)
        pending: dict[Any, tuple[WorkUnit, Any]] = {}
        free = list(actors)
        try:
            while queue or pending:
                while queue and free:
                    actor, unit = free.pop(), queue.pop(0)
                    pending[actor.call.remote(method, unit.payload)] = (unit, actor, time.perf_counter())
                ready, _ = ray.wait(list(pending), num_returns=1)
                unit, actor, t0 = pending.pop(ready[0])
                # submit-to-result time of one unit on one actor (includes the first unit's model load)
                counts["unit_seconds"].append((unit.size, time.perf_counter() - t0))
                try:
                    result = ray.get(ready[0])
                except Exception as exc:
                    raise MemgasError(
                        f"{desc}: unit {unit.part} failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[-1] if str(exc) else ''}. Completed units are kept; re-run to resume."
                    ) from exc
                write(unit, result)
                bar.update(unit.size)
                free.append(actor)
        finally:
            for a in actors:
                ray.kill(a)
        return counts
    finally:
        bar.close()

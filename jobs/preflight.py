"""Pre-flight: every device, backend and GPU request a command's stages imply, checked before the first stage.

A command runs a slice of :data:`memgas.jobs.stages.PIPELINE` (``run``: all of it, ``index``, ``answer``) or
serves the LLM (``serve``). :func:`needs` derives from the config which of those stages compute with the
encoder, the LLM and the kernels; :func:`check` refuses, in one line and within seconds (no model load, no
ingest, before Ray starts), a setting that cannot work (:class:`ConfigError`, exit 2: a CUDA device with no
GPU per Ray worker, an ONNX encoder on CUDA, an OpenAI backend without a URL) and a device or package this
machine lacks (:class:`EnvironmentFailure`, exit 3: CUDA, vLLM, CuPy, llama.cpp). Under Ray the packages are
looked up on the driver, which is assumed to run the workers' install (as ``placement.kernel_device`` does);
once Ray is up, :func:`check_cluster` checks each stage's GPU request (``Stage.num_gpus``, the number the
executor asks Ray for) against the nodes, where Ray alone would queue it forever.

Stages that a command does not run impose nothing: ``answer`` never loads the encoder (the bank holds the
vectors), ``index`` never the reader.

A setting that works but takes hours is said, not refused: JustMem's LLM extractor on a CPU backend
(:func:`memgas.pipeline.justmem.llm_estimate.llm_extractor_estimate`, logged by the cards stage once it knows how many sessions it will extract,
before the first of them) is a correctness check at this machine's speed, not a way to extract a dataset.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

from memgas.jobs import stages as S
from memgas.jobs.executor import ACTOR_GPU_HINT, TASK_GPU_HINT, require_gpus
from memgas.jobs.placement import encoder_device, local_cuda_devices, num_gpus, resolve_stage_runtimes
from memgas.jobs.stage import Stage, StageContext
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import ConfigError, EnvironmentFailure

log = logging.getLogger(__name__)

Command = Literal["run", "index", "answer", "serve"]
Model = Literal["encoder", "llm", "kernels"]

#: the stages each command runs (``profile`` is ``run``); ``serve`` runs none, it serves the LLM
SLICES: dict[str, tuple[str, ...]] = {"run": tuple(s.name for s in S.PIPELINE), "index": S.INDEX,
                                      "answer": S.ANSWER, "serve": ()}


def _placeholder_context(cfg: MemgasConfig, use_ray: bool) -> StageContext:
    """A context in which each stage can say what it computes with (:meth:`Stage.active`), before any bank is
    open or any runtime resolved: *whether* a stage uses an encoder or an LLM does not depend on the device
    it will run on, so a CPU placeholder stands for the runtimes (``placement.resolve_stage_runtimes``)."""
    ctx = StageContext(cfg, None, None, use_ray=use_ray)  # type: ignore[arg-type] - no stage reads a bank here
    ctx.resolved = {"encoder": {"device": "cpu", "dtype": "float32", "runtime": "torch"},
                    "llm": {"device": "cpu", "dtype": "float32"}, "model_files": {}}
    return ctx


def stage_models(stage: Stage, ctx: StageContext) -> tuple[Model, ...]:
    """What ``stage`` computes with under ``ctx.cfg``: kernel tasks, an encoder, an LLM (none: a disabled
    stage, and actors that hold neither, such as the LLM-free generator and JustMem's LLM-free extractor)."""
    active = stage.active(ctx)
    if active is None or stage.where == "driver":
        return ()
    if stage.where == "task":
        return ("kernels",)
    if stage.model in ("encoder", "llm"):
        return (stage.model,)
    m = active.model  # what the actor loads: an LLM where use_llm / llm_runtime say so, an encoder where given
    uses_llm = bool(m.get("use_llm") or m.get("llm_runtime"))
    return tuple(x for x, used in (("encoder", m.get("encoder") is not None), ("llm", uses_llm)) if used)


def needs(cfg: MemgasConfig, command: Command, use_ray: bool = False) -> dict[Model, tuple[str, ...]]:
    """{model: the stages of ``command`` that compute with it}, in pipeline order; ``serve``: the LLM."""
    if command == "serve":
        return {"llm": ("serve",)}
    from memgas.jobs.runner import unused_stages  # noqa: PLC0415  (runner imports the executor, as here)

    ctx = _placeholder_context(cfg, use_ray)
    ctx.pipeline = S.PIPELINE
    # a stage the config enables but whose output no running step reads does not run (runner.unused_stages):
    # what it would compute with is not asked for (JustMem's methods alone need no MemGAS generator's LLM)
    unused = unused_stages(ctx)
    out: dict[Model, tuple[str, ...]] = {}
    for stage in S.PIPELINE:
        if stage.name in SLICES[command] and isinstance(stage, Stage) and stage.name not in unused:
            for model in stage_models(stage, ctx):
                out[model] = (*out.get(model, ()), stage.name)
    return {m: out[m] for m in ("encoder", "llm", "kernels") if m in out}


def _stages(names: tuple[str, ...]) -> str:
    return f"(stages {', '.join(names)})"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _encoder_device(cfg: MemgasConfig, use_ray: bool) -> str:
    """The encoder's device as the run resolves it (torch imported only for "auto" without Ray)."""
    local = cfg.encoder.device == "auto" and not use_ray and local_cuda_devices() > 0
    return encoder_device(cfg, use_ray, local)


def config_problems(cfg: MemgasConfig, command: Command, use_ray: bool) -> list[str]:
    """Settings of ``cfg`` that cannot work for the stages of ``command`` (exit 2), one message each. Under Ray
    a worker that requests no GPU sees none (Ray sets CUDA_VISIBLE_DEVICES=""): a CUDA device with no GPUs
    per worker would fail the stage, model actors only after several reloads (``--no-ray`` uses this
    process's GPUs: :func:`environment_problems`)."""
    out: list[str] = []
    n = needs(cfg, command, use_ray)
    actor_gpus, task_gpus = cfg.ray.num_gpus_per_model_actor, cfg.ray.num_gpus_per_task
    if "encoder" in n:
        e = cfg.encoder
        if use_ray and e.device == "cuda" and actor_gpus == 0:  # a worker that requests no GPU sees none
            out.append(f"encoder.device=cuda but ray.num_gpus_per_model_actor=0 gives the encoder actors no GPU "
                       f"{_stages(n['encoder'])}; set ray.num_gpus_per_model_actor=1 or encoder.device=auto")
        elif e.runtime not in ("auto", "torch"):
            from memgas.pipeline.models.encoder_runtime import resolve_runtime

            try:
                resolve_runtime(e.runtime, _encoder_device(cfg, use_ray))
            except ValueError as exc:
                out.append(f"{exc} {_stages(n['encoder'])}")
    if "llm" in n:
        llm = cfg.llm
        if llm.backend == "openai" and not llm.base_url:
            out.append(f"llm.backend=openai needs llm.base_url (e.g. http://localhost:8000/v1) {_stages(n['llm'])}")
        if use_ray and llm.backend == "vllm" and actor_gpus == 0:
            out.append(f"llm.backend=vllm runs on a GPU but ray.num_gpus_per_model_actor=0 gives its actors none "
                       f"{_stages(n['llm'])}; set ray.num_gpus_per_model_actor=1")
    if "kernels" in n and use_ray and cfg.retrieval.device == "cuda" and task_gpus == 0:
        out.append(f"retrieval.device=cuda but ray.num_gpus_per_task=0 gives the association/ranking tasks no GPU "
                   f"{_stages(n['kernels'])}; set ray.num_gpus_per_task (e.g. 0.25) or retrieval.device=auto")
    return out


def environment_problems(cfg: MemgasConfig, command: Command, use_ray: bool) -> list[str]:
    """Devices and packages the stages of ``command`` need that this process lacks (exit 3). Without Ray the
    devices are this process's; under Ray only the packages are checked here (the GPUs: :func:`check_cluster`)."""
    out: list[str] = []
    n = needs(cfg, command, use_ray)
    if "encoder" in n and not use_ray and cfg.encoder.device == "cuda" and local_cuda_devices() == 0:
        out.append(f"encoder.device=cuda but torch sees no CUDA device {_stages(n['encoder'])}; set encoder.device=auto "
                   "(or cpu), or run where torch has a CUDA build and a GPU")
    if "llm" in n:
        llm, where = cfg.llm, _stages(n["llm"])
        if llm.backend == "vllm":
            if not _installed("vllm"):
                out.append(f"llm.backend=vllm needs the package 'vllm', which is not installed {where}; make setup-gpu "
                           "installs it (the gpu extra), or choose another llm.backend")
            elif not use_ray and (seen := local_cuda_devices()) < llm.tensor_parallel_size:
                out.append(f"llm.backend=vllm with llm.tensor_parallel_size={llm.tensor_parallel_size} needs as many "
                           f"CUDA devices but torch sees {seen} {where}; run where there are, or choose a CPU "
                           "llm.backend (transformers-gguf)")
        if llm.backend in ("transformers-gguf", "hf") and not _installed("lmformatenforcer"):
            # JSON schemas (JustMem cards and plans, serve's response_format) are enforced with it on this backend
            out.append(f"llm.backend={llm.backend} needs the package 'lm-format-enforcer', which is not installed "
                       f"{where}; make setup installs it (pyproject.toml)")
        if llm.backend == "llama-cpp" and not _installed("llama_cpp"):
            out.append(f"llm.backend=llama-cpp needs the package 'llama_cpp', which is not installed {where}; "
                       "pip install llama-cpp-python, or choose llm.backend=transformers-gguf")
    if "kernels" in n and cfg.retrieval.device == "cuda":
        where = _stages(n["kernels"])
        if not _installed("cupy"):
            out.append(f"retrieval.device=cuda needs CuPy, which is not installed {where}; make setup-gpu installs it "
                       "(the gpu extra), or set retrieval.device=auto (or cpu)")
        elif not use_ray:
            from memgas.kernels.backend import get_xp

            try:
                get_xp("cuda")
            except RuntimeError:
                out.append(f"retrieval.device=cuda but CuPy sees no CUDA GPU {where}; set retrieval.device=auto (or cpu)")
    return out


def check(cfg: MemgasConfig, command: Command, use_ray: bool) -> None:
    """Refuse ``cfg`` for ``command`` before any work: the first problem as one line, a setting that cannot
    work (:class:`ConfigError`, exit 2) before a missing device or package (:class:`EnvironmentFailure`, 3)."""
    for message in config_problems(cfg, command, use_ray):
        raise ConfigError(message)
    for message in environment_problems(cfg, command, use_ray):
        raise EnvironmentFailure(message)


def check_cluster(cfg: MemgasConfig, command: Command) -> None:
    """Under Ray, once connected: each stage's GPU request (what the executor will ask Ray for) against the
    cluster's live nodes, before the first stage (exit 3, :func:`memgas.jobs.executor.require_gpus`)."""
    ctx = StageContext(cfg, None, None, use_ray=True)  # type: ignore[arg-type] - devices need no bank
    resolve_stage_runtimes(ctx)
    for stage in S.PIPELINE:
        if stage.name not in SLICES[command] or not isinstance(stage, Stage) or stage.where == "driver":
            continue
        active = stage.active(ctx)
        if active is None:
            continue
        if stage.where == "task":
            require_gpus(f"stage {stage.name}", num_gpus(stage, active, ctx), TASK_GPU_HINT)
        else:
            require_gpus(f"stage {stage.name} ({stage.model} actors)", num_gpus(stage, active, ctx), ACTOR_GPU_HINT)

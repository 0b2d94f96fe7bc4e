"""The models actors hold, built by :func:`make_model` from a stage's ``model`` kind and the config its
``active`` returns (the executor's model hosts call it; placement is :mod:`memgas.jobs.placement`'s)."""

from __future__ import annotations

from typing import Any

from memgas.jobs.placement import set_torch_threads
from memgas.jobs.worker_path import installed_packages_first


class Generator:
    """What a generation actor holds: the LLM (if the generator uses one) and the LLM-free generator."""

    def __init__(self, config: dict[str, Any]) -> None:
        from memgas.pipeline.config import EncoderConfig, GenerationConfig, LLMConfig
        from memgas.pipeline.llm_free import LLMFreeGenerator
        from memgas.pipeline.models.factory import make_encoder, make_llm

        self.cfg = GenerationConfig(**config["generation"])
        self.llm = (make_llm(LLMConfig(**config["llm"]), seed=config["seed"], **(config.get("llm_runtime") or {}))
                    if self.cfg.generator != "llm-free" else None)
        encoder = make_encoder(EncoderConfig(**config["encoder"])) if config.get("encoder") else None
        self.free = LLMFreeGenerator(encoder) if self.cfg.generator != "llm" else None


class JustMemModel:
    """What a cards or plan actor holds: the ``justmem`` section and the LLM only where the extractor (cards)
    or the planner (plan) is ``llm`` (the LLM-free ones need no model, so none is loaded)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from memgas.pipeline.config import JustMemConfig, LLMConfig
        from memgas.pipeline.models.factory import make_llm

        self.cfg = JustMemConfig(**config["justmem"])
        self.llm = (make_llm(LLMConfig(**config["llm"]), seed=config["seed"], **(config.get("llm_runtime") or {}))
                    if config.get("use_llm") else None)


def loads_torch_model(kind: str, config: dict[str, Any]) -> bool:
    """Whether the model of ``kind`` under ``config`` holds an encoder or an LLM (what computes with torch). The
    LLM-free generator and JustMem's LLM-free extractor and planner hold neither: their actors never import
    torch (1-2 s of each one's start) only to set its threads."""
    return kind in ("encoder", "llm") or bool(config.get("encoder") or config.get("llm_runtime") or config.get("use_llm"))


def make_model(kind: str, config: dict[str, Any]) -> Any:
    """The model an actor (or the in-process host) holds for stages of ``model = kind``."""
    from memgas.pipeline.config import EncoderConfig, LLMConfig
    from memgas.pipeline.models.factory import make_encoder, make_llm

    installed_packages_first()  # before transformers: see its docstring
    if loads_torch_model(kind, config):  # before the model is built: it computes with these threads
        set_torch_threads(config.get("threads"))
    if kind == "encoder":
        return make_encoder(EncoderConfig(**config["encoder"]))
    if kind == "llm":
        return make_llm(LLMConfig(**config["llm"]), seed=config["seed"], **(config.get("llm_runtime") or {}))
    if kind == "generator":
        return Generator(config)
    if kind == "justmem":
        return JustMemModel(config)
    raise ValueError(f"unknown model kind {kind!r}")


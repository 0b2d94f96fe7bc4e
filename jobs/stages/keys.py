"""Cache keys of content-addressed rows (generations, embeddings, cards, plans), derived from the stages'
cache keys: one function per key, so no stage builds another to learn its key."""

from __future__ import annotations

from typing import Any

from memgas.jobs.stage import StageContext
from memgas.jobs.stages.units import registered
from memgas.pipeline.config import MemgasConfig


def llm_identity(cfg: MemgasConfig) -> str:
    """The LLM's name as the keys of its outputs carry it (the ``smollm2`` alias as the model it names)."""
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, SMOLLM2_NAME

    return SMOLLM2_NAME if cfg.llm.model == SMOLLM2_ALIAS else cfg.llm.model


def generation_key(ctx: StageContext) -> tuple[str, str]:
    """(model, prompt_version) of this config's generations: a readable identity, and the prompt version
    suffixed with the generate stage's cache key (every declared field that can change an output)."""
    from memgas.pipeline.llm_free import LLM_FREE_NAME

    cfg = ctx.cfg
    stage = registered("generate")
    model = llm_identity(cfg) if stage.uses_llm(cfg) else LLM_FREE_NAME
    base = cfg.generation.prompt_version if stage.uses_llm(cfg) else "llm-free"
    return model, f"{base}@{stage.cache_key(ctx)}"


def encoder_config(ctx: StageContext) -> dict[str, Any]:
    """The encoder section with device and dtype resolved on the driver (so they can key the cache)."""
    return {**ctx.cfg.encoder.model_dump(), **ctx.resolved.get("encoder", {})}


def encoder_key(ctx: StageContext) -> str:
    """``embeddings.encoder`` of this config: readable name @ the encode stage's cache key."""
    from memgas.pipeline.generate import slug

    e = ctx.cfg.encoder
    return f"{slug(e.model)}@{registered('encode').cache_key(ctx)}"


def window_key(ctx: StageContext, max_tokens: int | None) -> str:
    """``embeddings.encoder`` of texts encoded with a window of ``max_tokens`` (None: the encoder's own):
    :func:`encoder_key` + the window. The key names only the window, so sessions and turn pairs at one
    window share it (and the encode units that let equal inputs run once)."""
    return encoder_key(ctx) if max_tokens is None else f"{encoder_key(ctx)}~max{max_tokens}"


def encoder_keys(ctx: StageContext) -> dict[str, str]:
    """Cache key per text role: ``main`` (summaries, keywords, hybrids, questions), ``session`` and ``pair``
    (``encoder.session_max_tokens`` / ``encoder.pair_max_tokens``, else ``main``'s)."""
    e = ctx.cfg.encoder
    return {"main": encoder_key(ctx), "session": window_key(ctx, e.session_max_tokens),
            "pair": window_key(ctx, e.pair_max_tokens)}


def accounting_keys(ctx: StageContext) -> dict[str, str]:
    """Keyword arguments of :func:`memgas.pipeline.encode.encoding_accounting` for this config."""
    keys = encoder_keys(ctx)
    return {"key": keys["main"], "pair_key": keys["pair"], "session_key": keys["session"]}


def cards_key(ctx: StageContext) -> str:
    """The ``extractor`` column of this config's rows of ``cards``: the readable extractor key @ the cards
    stage's cache key."""
    from memgas.pipeline.justmem.extract import extractor_key

    cfg = ctx.cfg
    stage = registered("cards")
    return f"{extractor_key(cfg.justmem, llm_identity(cfg) if stage.uses_llm(cfg) else None)}@{stage.cache_key(ctx)}"


def plan_key(ctx: StageContext) -> str:
    """The ``planner`` column of this config's rows of ``plans`` (and the planner the card reader names)."""
    from memgas.pipeline.justmem.plan import planner_key

    cfg = ctx.cfg
    return planner_key(cfg.justmem, llm_identity(cfg) if registered("plan").uses_llm(cfg) else None)


def justmem_upstream(ctx: StageContext) -> dict[str, str | None]:
    """What the cards and plan stages committed (their fingerprints before they ran), for the fingerprints of
    the stages that read them only when JustMem is selected (encode, rank)."""
    return {u: ctx.outputs.get(u) or ctx.fingerprints.get(u) for u in ("cards", "plan")}

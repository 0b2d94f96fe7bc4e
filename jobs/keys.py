"""What keys an output and what never does: the config contract's field lists, and the identities of the
producers of content-addressed rows (generations, embeddings, cards) and of plans.

A content-addressed row carries its producer's key (``generations.prompt_version``, ``embeddings.encoder``,
``cards.extractor``): a function of the config and the resolved runtime facts alone, computed here once,
so a stage that reads those rows (or the report) computes the same key from its own context and never asks
the producing stage. Each key hashes a producer tag (the stage's name and its version, :data:`PRODUCER_VERSIONS`),
the values of the fields that can change the rows, and the resolved facts.
"""

from __future__ import annotations

from typing import Any

from memgas.jobs.stage import StageContext, config_value, short_hash
from memgas.pipeline.config import MemgasConfig

#: The versions of the stages whose rows are content-addressed, their one home (each stage's ``version`` is
#: its entry): a version bump changes the stage's fingerprint and the key its rows carry, so rows written
#: before are not reused. The values are those of the stages that wrote the rows banks hold now.
PRODUCER_VERSIONS: dict[str, str] = {"generate": "2", "encode": "2", "cards": "1"}

#: Settings that never change an output: where and how fast work runs. Never part of a fingerprint.
#: Batch and unit sizes are here too: an encoder vector is a function of its text alone (the encoder never
#: pads a batch, pipeline/models/encoders.py), and kernels run per history. The one exception left is an
#: LLM's padded batches (``llm.batch_size`` is declared; which sessions share a unit is not): a resumed run
#: keeps its units from the plan, and docs/reliability.md says what that leaves open.
RUNTIME_ONLY: tuple[str, ...] = (
    "name", "output_dir", "bank_dir",
    "encoder.batch_size", "encoder.actors",
    "llm.api_key_env", "llm.concurrency", "llm.timeout_s", "llm.max_retries", "llm.gpu_memory_utilization",
    "llm.threads",
    "ray.address", "ray.num_cpus", "ray.num_gpus_per_model_actor", "ray.num_gpus_per_task", "ray.model_actors",
    "ray.shard_size", "ray.generate_unit", "ray.encode_unit",
    "evaluation.plots",
)

#: LLM settings that change what an LLM writes (backend and model, context, batching, sampling).
LLM_OUTPUT_FIELDS: tuple[str, ...] = (
    "llm.backend", "llm.model", "llm.base_url", "llm.context_tokens", "llm.batch_size", "llm.temperature",
    "llm.tensor_parallel_size", "seed",
)

ENCODER_OUTPUT_FIELDS: tuple[str, ...] = (
    "encoder.backend", "encoder.model", "encoder.max_tokens", "encoder.long_text", "encoder.dtype",
    "encoder.device", "encoder.runtime",
)

#: the generator's declared fields (the generate stage's): which of them are active is :func:`generator_identity`'s
GENERATOR_FIELDS: tuple[str, ...] = (
    "generation.generator", "generation.summary_source", "generation.prompt_version", "generation.single_call",
    "generation.max_input_tokens", "generation.summary_max_tokens", "generation.keywords_max_tokens",
    *LLM_OUTPUT_FIELDS, *ENCODER_OUTPUT_FIELDS)
EXTRACTOR_FIELDS: tuple[str, ...] = ("justmem.extractor", "justmem.extract_max_tokens",
                                     "justmem.extract_max_input_tokens", *LLM_OUTPUT_FIELDS)
PLANNER_FIELDS: tuple[str, ...] = ("justmem.planner", "justmem.rewrites", "justmem.plan_max_tokens", *LLM_OUTPUT_FIELDS)


def present_fields(cfg: MemgasConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` that exist in this config (``encoder.runtime`` is optional across versions)."""
    out = []
    for n in names:
        try:
            config_value(cfg, n)
        except AttributeError:
            continue
        out.append(n)
    return tuple(out)


def _producer(stage: str) -> tuple[str, str]:
    return stage, PRODUCER_VERSIONS[stage]


def _key(tag: tuple[str, str], cfg: MemgasConfig, fields: tuple[str, ...], resolved: dict[str, Any]) -> str:
    return short_hash([*tag, {f: config_value(cfg, f) for f in fields}, resolved])


def llm_identity(cfg: MemgasConfig) -> str:
    """The LLM's name as the keys of its outputs carry it (the ``smollm2`` alias as the model it names)."""
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, SMOLLM2_NAME

    return SMOLLM2_NAME if cfg.llm.model == SMOLLM2_ALIAS else cfg.llm.model


def llm_resolved(ctx: StageContext, prompts: str) -> dict[str, Any]:
    """What keys an LLM's outputs beside the config: fp32 CPU and bf16 GPU outputs differ (device, dtype),
    weights changed in place (file digests), and the prompt texts."""
    return {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
            "prompts": prompts}


# -- the generator (generations, derived texts) ---------------------------------------------------------
def generator_uses_llm(cfg: MemgasConfig) -> bool:
    return cfg.generation.generator != "llm-free"


def generator_uses_encoder(cfg: MemgasConfig) -> bool:
    """The LLM-free generator may rank sentences with the encoder (``LLMFreeGenerator.NEEDS_ENCODER``)."""
    from memgas.pipeline.llm_free import LLMFreeGenerator

    return cfg.generation.generator != "llm" and bool(getattr(LLMFreeGenerator, "NEEDS_ENCODER", True))


def generator_identity(ctx: StageContext) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(active fields, resolved facts) of the generator under this config."""
    from memgas.pipeline.llm_free import LLM_FREE_VERSION

    cfg = ctx.cfg
    own = ["generation.generator", "generation.summary_source"]
    resolved: dict[str, Any] = {}
    if cfg.generation.generator != "llm":
        resolved["llm_free"] = LLM_FREE_VERSION
    files = ctx.resolved.get("model_files") or {}
    if generator_uses_llm(cfg):
        own += ["generation.prompt_version", "generation.single_call", "generation.max_input_tokens",
                "generation.summary_max_tokens", "generation.keywords_max_tokens", *LLM_OUTPUT_FIELDS]
    if generator_uses_encoder(cfg):
        own += ENCODER_OUTPUT_FIELDS
        resolved["encoder"] = ctx.resolved.get("encoder")
        resolved["encoder_files"] = files.get("encoder")
    if generator_uses_llm(cfg):
        from memgas.pipeline.prompts import generation_prompt_digest

        resolved.update(llm_resolved(ctx, generation_prompt_digest(cfg.generation.prompt_version)))
    return present_fields(cfg, tuple(own)), resolved


def generation_key(ctx: StageContext) -> tuple[str, str]:
    """(model, prompt_version) of this config's rows of ``generations``: a readable identity, and the prompt
    version suffixed with the generator's key (every field that can change a generation)."""
    from memgas.pipeline.llm_free import LLM_FREE_NAME

    cfg = ctx.cfg
    fields, resolved = generator_identity(ctx)
    model = llm_identity(cfg) if generator_uses_llm(cfg) else LLM_FREE_NAME
    base = cfg.generation.prompt_version if generator_uses_llm(cfg) else "llm-free"
    return model, f"{base}@{_key(_producer('generate'), cfg, fields, resolved)}"


# -- the encoder (embeddings) ----------------------------------------------------------------------------
def encoder_config(ctx: StageContext) -> dict[str, Any]:
    """The encoder section with device and dtype resolved on the driver (so they can key the cache)."""
    return {**ctx.cfg.encoder.model_dump(), **ctx.resolved.get("encoder", {})}


def encoder_identity(ctx: StageContext) -> tuple[tuple[str, ...], dict[str, Any]]:
    return present_fields(ctx.cfg, ENCODER_OUTPUT_FIELDS), {
        "encoder": ctx.resolved.get("encoder"), "encoder_files": (ctx.resolved.get("model_files") or {}).get("encoder")}


def encoder_key(ctx: StageContext) -> str:
    """``embeddings.encoder`` of this config: readable name @ the encoder's key."""
    from memgas.pipeline.generate import slug

    fields, resolved = encoder_identity(ctx)
    return f"{slug(ctx.cfg.encoder.model)}@{_key(_producer('encode'), ctx.cfg, fields, resolved)}"


def window_key(ctx: StageContext, max_tokens: int | None) -> str:
    """``embeddings.encoder`` of texts encoded with a window of ``max_tokens`` (None: the encoder's own):
    :func:`encoder_key` + the window. The key names only the window, so sessions and turn pairs at one
    window share it (and the encode units that let equal inputs run once)."""
    return encoder_key(ctx) if max_tokens is None else f"{encoder_key(ctx)}~max{max_tokens}"


def encoder_keys(ctx: StageContext) -> dict[str, str]:
    """Cache key per text role: ``main`` (summaries, keywords, hybrids, questions, cards, rewrites),
    ``session`` and ``pair`` (``encoder.session_max_tokens`` / ``encoder.pair_max_tokens``, else ``main``'s)."""
    e = ctx.cfg.encoder
    return {"main": encoder_key(ctx), "session": window_key(ctx, e.session_max_tokens),
            "pair": window_key(ctx, e.pair_max_tokens)}


def accounting_keys(ctx: StageContext) -> dict[str, str]:
    """Keyword arguments of :func:`memgas.pipeline.encode.encoding_accounting` for this config."""
    keys = encoder_keys(ctx)
    return {"key": keys["main"], "pair_key": keys["pair"], "session_key": keys["session"]}


# -- JustMem's extractor (cards) and planner (plans) -------------------------------------------------------
def extractor_uses_llm(cfg: MemgasConfig) -> bool:
    return cfg.justmem.extractor == "llm"


def planner_uses_llm(cfg: MemgasConfig) -> bool:
    return cfg.justmem.planner == "llm"


def extractor_identity(ctx: StageContext) -> tuple[tuple[str, ...], dict[str, Any]]:
    from memgas.pipeline.justmem.extract import LLM_EXTRACTOR_VERSION, LLM_FREE_EXTRACTOR

    cfg = ctx.cfg
    if not extractor_uses_llm(cfg):
        return present_fields(cfg, ("justmem.extractor",)), {"llm_free": LLM_FREE_EXTRACTOR}
    return present_fields(cfg, EXTRACTOR_FIELDS), llm_resolved(ctx, LLM_EXTRACTOR_VERSION)


def cards_key(ctx: StageContext) -> str:
    """The ``extractor`` column of this config's rows of ``cards``: the readable extractor key @ its key."""
    from memgas.pipeline.justmem.extract import extractor_key

    cfg = ctx.cfg
    fields, resolved = extractor_identity(ctx)
    readable = extractor_key(cfg.justmem, llm_identity(cfg) if extractor_uses_llm(cfg) else None)
    return f"{readable}@{_key(_producer('cards'), cfg, fields, resolved)}"


def planner_identity(ctx: StageContext) -> tuple[tuple[str, ...], dict[str, Any]]:
    from memgas.pipeline.justmem.plan import LLM_FREE_PLANNER, LLM_PLANNER_VERSION

    cfg = ctx.cfg
    if not planner_uses_llm(cfg):
        return present_fields(cfg, ("justmem.planner", "justmem.rewrites")), {"llm_free": LLM_FREE_PLANNER}
    return present_fields(cfg, PLANNER_FIELDS), llm_resolved(ctx, LLM_PLANNER_VERSION)


def plan_key(ctx: StageContext) -> str:
    """The ``planner`` column of this config's rows of ``plans`` (and the planner the card reader names)."""
    from memgas.pipeline.justmem.plan import planner_key

    cfg = ctx.cfg
    return planner_key(cfg.justmem, llm_identity(cfg) if planner_uses_llm(cfg) else None)

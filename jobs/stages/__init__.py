"""The pipeline's stages, in order, and the config contract (see :mod:`memgas.jobs.stage`).

``PIPELINE`` is the main job; ``memgas index`` runs the slice ``INDEX`` and ``memgas answer`` the slice
``ANSWER``. Adding a stage (a new granularity, a new reader) means writing one module here (one class) and
adding it to ``PIPELINE``. The helpers the stages share live in small modules beside them: ``fields`` (the
config contract's lists), ``keys`` (cache keys), ``units`` (chunks, shards, part prefixes), ``texts``,
``models`` (what actors hold), ``placement`` (devices, GPUs, threads), ``justmem``, ``shards`` (kernel stages'
node matrices) and ``tokens`` (tokens per method).

Config contract: every leaf of :class:`MemgasConfig` is declared by at least one stage (it can change
that stage's output, so it is part of its fingerprint) or listed once in ``RUNTIME_ONLY`` (it changes
where or how fast work runs, never what it produces, and is never part of a fingerprint).
``tests/jobs/test_stages.py`` enumerates the leaves and fails on a leaf that is neither.

Every name below is re-exported here: callers import them from ``memgas.jobs.stages``.
"""

from __future__ import annotations

from memgas.jobs.stage import Stage
from memgas.jobs.stages.associate import AssociateStage
from memgas.jobs.stages.cards import CardsStage
from memgas.jobs.stages.encode import EncodeStage
from memgas.jobs.stages.evaluate import EvaluateStage
from memgas.jobs.stages.fields import (
    ENCODER_OUTPUT_FIELDS,
    LLM_OUTPUT_FIELDS,
    RUNTIME_ONLY,
    present_fields,
)
from memgas.jobs.stages.generate import GenerateStage
from memgas.jobs.stages.ingest import IngestStage, ingest_output
from memgas.jobs.stages.judge import JudgeStage
from memgas.jobs.stages.justmem import (
    JustMemActorStage,
    current_cards,
    current_plans,
    justmem_enabled,
    justmem_text_groups,
    justmem_texts,
    plan_profiles,
)
from memgas.jobs.stages.keys import (
    accounting_keys,
    cards_key,
    encoder_config,
    encoder_key,
    encoder_keys,
    generation_key,
    justmem_upstream,
    llm_identity,
    plan_key,
    window_key,
)
from memgas.jobs.stages.models import FACTORY, Generator, JustMemModel, make_model
from memgas.jobs.stages.nodes import NodesStage
from memgas.jobs.stages.placement import (
    encoder_on_cuda,
    kernel_device,
    llm_on_cuda,
    model_file_digests,
    model_gpus,
    resolve_llm_runtime,
    resolve_stage_runtimes,
)
from memgas.jobs.stages.plan import PlanStage
from memgas.jobs.stages.rank import (
    JUSTMEM_RANK_FIELDS,
    RankStage,
    edges_of,
    query_vectors,
)
from memgas.jobs.stages.read import READ_FIELDS, ReadStage, current_answers
from memgas.jobs.stages.shards import (
    HistoryShardStage,
    matrix_loader,
    node_matrix,
    owned,
)
from memgas.jobs.stages.texts import TextBlocks, rederive_texts, texts_by_hash
from memgas.jobs.stages.tokens import GENERATED_METHODS, PLANNED_METHODS, method_tokens
from memgas.jobs.stages.units import (
    attempt_of,
    chunk,
    cost_chunks,
    drop_other_parts,
    even_chunks,
    history_shards,
    parts_with_prefix,
    prefix_of,
    registered,
)

__all__ = [
    "ANSWER", "ENCODER_OUTPUT_FIELDS", "FACTORY", "GENERATED_METHODS", "INDEX", "JUSTMEM_RANK_FIELDS",
    "LLM_OUTPUT_FIELDS", "PIPELINE", "PLANNED_METHODS", "READ_FIELDS", "RUNTIME_ONLY", "STAGES",
    "AssociateStage", "CardsStage", "EncodeStage", "EvaluateStage", "GenerateStage", "Generator",
    "HistoryShardStage", "IngestStage", "JudgeStage", "JustMemActorStage", "JustMemModel", "NodesStage",
    "PlanStage", "RankStage", "ReadStage", "TextBlocks",
    "accounting_keys", "attempt_of", "cards_key", "chunk", "cost_chunks", "current_answers", "current_cards",
    "current_plans", "declared_fields", "drop_other_parts", "edges_of", "encoder_config", "encoder_key",
    "encoder_keys", "encoder_on_cuda", "even_chunks", "generation_key", "ingest_output", "history_shards", "justmem_enabled",
    "justmem_text_groups", "justmem_texts", "justmem_upstream", "kernel_device", "llm_identity", "llm_on_cuda", "make_model",
    "matrix_loader", "method_tokens", "model_file_digests", "model_gpus", "node_matrix", "owned",
    "parts_with_prefix", "plan_key", "plan_profiles", "prefix_of", "present_fields", "query_vectors",
    "rederive_texts", "registered", "resolve_llm_runtime", "resolve_stage_runtimes", "texts_by_hash",
    "window_key",
]

PIPELINE: tuple[Stage, ...] = (IngestStage(), GenerateStage(), CardsStage(), PlanStage(), NodesStage(), EncodeStage(),
                               AssociateStage(), RankStage(), ReadStage(), JudgeStage(), EvaluateStage())
STAGES: dict[str, Stage] = {s.name: s for s in PIPELINE}
INDEX: tuple[str, ...] = ("generate", "cards", "plan", "nodes", "encode", "associate")
ANSWER: tuple[str, ...] = ("rank", "read", "judge", "evaluate")


def declared_fields() -> set[str]:
    """Every config leaf some stage declares (statically: whatever the config, it may change an output)."""
    return {f for s in PIPELINE for f in s.config_fields}

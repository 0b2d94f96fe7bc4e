"""The config contract's field lists: settings that never change an output (``RUNTIME_ONLY``) and the
LLM and encoder settings that do (declared by every stage that runs those models)."""

from __future__ import annotations

from memgas.jobs.stage import config_value
from memgas.pipeline.config import MemgasConfig

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

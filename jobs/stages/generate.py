"""The generate stage: a summary and keywords per unique session."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import Stage, StageContext, table_digest
from memgas.jobs.stages.fields import (
    ENCODER_OUTPUT_FIELDS,
    LLM_OUTPUT_FIELDS,
    present_fields,
)
from memgas.jobs.stages.keys import encoder_config, generation_key
from memgas.jobs.stages.models import Generator
from memgas.jobs.stages.placement import (
    encoder_on_cuda,
    llm_on_cuda,
    model_gpus,
)
from memgas.jobs.stages.texts import TextBlocks, unit_texts
from memgas.jobs.stages.units import even_chunks
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError


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
    failure_stat = "llm_failures"

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
        return present_fields(cfg, tuple(own))

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
        return {"generation": cfg.generation.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed,
                "llm_runtime": ctx.resolved.get("llm") if self.uses_llm(cfg) else None,
                "encoder": encoder_config(ctx) if self.uses_encoder(cfg) else None}

    def num_gpus(self, ctx: StageContext) -> float:
        """A GPU per actor only when its LLM or its encoder runs on CUDA (the LLM-free generator needs none)."""
        cfg = ctx.cfg
        return model_gpus(ctx, (self.uses_llm(cfg) and llm_on_cuda(ctx))
                           or (self.uses_encoder(cfg) and encoder_on_cuda(ctx)))

    def fits_one_core(self, ctx: StageContext) -> bool:
        """The LLM-free generator (no model: tf-idf in Python/NumPy) does; a generator that holds an LLM or
        an encoder does not."""
        return not self.uses_llm(ctx.cfg) and not self.uses_encoder(ctx.cfg)

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
        texts = unit_texts(ctx, "generate:texts", unit, _item_hashes(unit))
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
        if ctx.cache.pop(f"rebuilt:{self.name}", False):
            # a damaged texts part was dropped: its derived texts come back from the generations (a unit only
            # runs for sessions without generations, so no unit would write them again)
            from memgas.jobs.stages.texts import rederive_texts

            rederive_texts(ctx, None)
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

    def stop_message(self, stats: dict[str, Any]) -> str | None:
        # downstream stages would index empty summaries: stop here; the next run retries the failed rows
        return (f"generate: {stats.get('llm_failures')} generations failed in the LLM backend "
                f"(first: {stats.get('first_error')}); check llm.backend/llm.base_url and re-run "
                "(finished sessions are kept)")

    def output_digest(self, ctx: StageContext, parts: dict[str, str]) -> str:
        """This config's rows of ``generations`` (the table is shared by every config: other configs' rows
        must not change what downstream stages see)."""
        model, version = self.key(ctx)
        sessions = sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
        rows = ctx.bank.read("generations", filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)
                             & pc.field("text_hash").isin(sessions))
        return table_digest(rows.sort_by([("text_hash", "ascending"), ("kind", "ascending")]))


def _item_hashes(unit: dict[str, Any]) -> list[str]:
    return [it[0] for it in unit["items"]]

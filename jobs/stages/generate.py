"""The generate stage: a summary and keywords per unique session."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import keys
from memgas.jobs.models import Generator
from memgas.jobs.stage import Active, Stage, StageContext, values_digest
from memgas.jobs.stages.texts import TextBlocks, unit_texts
from memgas.jobs.tables import Table
from memgas.jobs.units import even_chunks
from memgas.pipeline.errors import BankError


def _this_config(ctx: StageContext) -> pa.Table:
    """This config's rows of ``generations`` for the bank's sessions (the table is shared by every config
    and dataset: other rows must not change what downstream stages see)."""
    model, version = keys.generation_key(ctx)
    sessions = sorted(set(ctx.bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
    rows = ctx.bank.read("generations", filter=(pc.field("model") == model) & (pc.field("prompt_version") == version)
                         & pc.field("text_hash").isin(sessions))
    return rows.sort_by([("text_hash", "ascending"), ("kind", "ascending")])


#: rows per chunk of :func:`_this_config_digest` (part of its definition)
DIGEST_CHUNK_ROWS = 8192


def _this_config_digest(ctx: StageContext) -> str:
    """The digest of :func:`_this_config`'s rows (the same rows, in the same order) without holding them:
    ``generations`` merged in its key order (text_hash, kind, model, prompt_version), which for one model and
    prompt version is the (text_hash, kind) order that :func:`_this_config` sorts by, filtered a batch at a
    time and digested in chunks of :data:`DIGEST_CHUNK_ROWS` rows (:func:`values_digest`). Memory: the
    merge's buffers and the sessions' hashes."""
    from memgas.pipeline.compaction import regroup
    from memgas.pipeline.schema import schema_for

    if not ctx.bank.exists("generations"):
        return values_digest([])
    model, version = keys.generation_key(ctx)
    sessions = pc.unique(ctx.bank.read("sessions", ["text_hash"])["text_hash"])
    mine = (pc.field("model") == model) & (pc.field("prompt_version") == version) & \
        pc.field("text_hash").isin(sessions)
    columns = schema_for("generations").names
    rows = (t.filter(mine).select(columns) for t in ctx.bank.iter_merged("generations"))
    return values_digest(regroup(rows, DIGEST_CHUNK_ROWS))


def _this_config_summed(ctx: StageContext) -> str:
    """The order-free digest of :func:`_this_config`'s rows from the bank's cached row hashes
    (:func:`memgas.pipeline.row_hashes.summed_digest`): an append hashes the generations it added."""
    from memgas.pipeline.row_hashes import summed_digest
    from memgas.pipeline.schema import schema_for

    model, version = keys.generation_key(ctx)
    sessions = pc.unique(ctx.bank.read("sessions", ["text_hash"])["text_hash"].combine_chunks())

    def select(k: pa.Table) -> pa.Array:
        return pc.and_(pc.and_(pc.equal(k["model"], model), pc.equal(k["prompt_version"], version)),
                       pc.is_in(k["text_hash"], value_set=sessions))

    return summed_digest(ctx.bank, "generations", schema_for("generations").names, select)


GENERATIONS = Table("generations", "content", retried=True, rows=_this_config, digest=_this_config_digest,
                    digest_since="streamed-2", summed=_this_config_summed)
#: summary, keyword and hybrid texts (a function of the generations and the session texts)
DERIVED_TEXTS = Table("derived_texts", "content", stored_in="texts")


class GenerateStage(Stage):
    """A summary and keywords per unique session (LLM, LLM-free, or LLM with LLM-free fallback).

    Content-addressed: rows are keyed by (session text_hash, kind, generator identity, prompt version @
    key, :func:`memgas.jobs.keys.generation_key`), shared by every history and dataset; a unit holds only
    sessions still missing.
    """

    name = "generate"
    version = keys.PRODUCER_VERSIONS["generate"]
    reads = ("sessions", "texts")
    writes = (GENERATIONS, DERIVED_TEXTS)
    fields = keys.GENERATOR_FIELDS
    where = "actor"
    model = "generator"

    def active(self, ctx: StageContext) -> Active:
        cfg = ctx.cfg
        fields, resolved = keys.generator_identity(ctx)
        llm, encoder = keys.generator_uses_llm(cfg), keys.generator_uses_encoder(cfg)
        model, version = keys.generation_key(ctx)
        return Active(fields=fields, resolved=resolved,
                      params={"model": model, "version": version, "temperature": cfg.llm.temperature, "seed": cfg.seed},
                      model={"generation": cfg.generation.model_dump(), "llm": cfg.llm.model_dump(), "seed": cfg.seed,
                             "llm_runtime": ctx.resolved.get("llm") if llm else None,
                             "encoder": keys.encoder_config(ctx) if encoder else None})

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        from memgas.pipeline.prompts import dialogue_kind_for

        bank = ctx.bank
        model, version = keys.generation_key(ctx)
        # what is missing found by Arrow (an append's sessions out of 10^6: no Python value per bank row)
        sessions = bank.read("sessions", ["text_hash", "dataset_summary"])
        uniq = pc.unique(sessions["text_hash"].combine_chunks())
        have: dict[str, pa.Array] = {k: pa.array([], pa.string()) for k in ("summary", "keywords")}
        if bank.exists("generations"):
            g = bank.read("generations", ["text_hash", "kind", "error"],
                          filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
            # backend failures (timeouts, HTTP) are retried; unusable outputs are not
            kept = pc.invert(pc.fill_null(pc.starts_with(g["error"], "llm:"), False))
            g = g.filter(kept)
            have = {k: g["text_hash"].filter(pc.equal(g["kind"], k)).combine_chunks() for k in have}
        done = {k: pc.is_in(uniq, value_set=v) for k, v in have.items()}
        short = pc.invert(pc.and_(done["summary"], done["keywords"]))
        missing = uniq.filter(short)
        flags = {k: v.filter(short).to_pylist() for k, v in done.items()}
        lacking = {h: sorted(k for k in flags if not flags[k][i]) for i, h in enumerate(missing.to_pylist())}
        # a session's dataset summary: the first non-empty one among the rows of its text
        mine = sessions.filter(pc.is_in(sessions["text_hash"], value_set=missing))
        dsum: dict[str, str | None] = {}
        for h, d in zip(mine["text_hash"].to_pylist(), mine["dataset_summary"].to_pylist()):
            if h not in dsum or (dsum[h] is None and d):
                dsum[h] = d
        kind = dialogue_kind_for((bank.manifest.get("datasets") or [{}])[-1].get("format"))
        todo = sorted(lacking)
        return [{"size": len(b), "kind": kind, "items": [[h, dsum[h], lacking[h]] for h in b]}
                for b in even_chunks(todo, ctx.cfg.ray.generate_unit)]

    #: session texts per read of the bank (TextBlocks; sessions are long, ~9 kB on LongMemEval)
    read_block_texts = 2048

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        if "texts" not in ctx.scratch:  # one read of the bank per block of the units about to run
            ctx.scratch["texts"] = TextBlocks(ctx.units, _item_hashes, self.read_block_texts)
        texts = unit_texts(ctx, unit, _item_hashes(unit))
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
        if ctx.cache.pop(f"rebuilt:{self.name}", False):
            # a damaged texts part was dropped: its derived texts come back from the generations (a unit only
            # runs for sessions without generations, so no unit would write them again)
            from memgas.jobs.stages.texts import rederive_texts

            rederive_texts(ctx, None)
            ctx.bank.compact("texts")  # as the table kinds leave a content table: one sorted part
        model, version = keys.generation_key(ctx)
        mine = ctx.bank.read("generations", ["prompt_tokens", "completion_tokens", "error", "fallback"],
                             filter=(pc.field("model") == model) & (pc.field("prompt_version") == version))
        err = mine["error"].to_pylist()
        failed = [e for e in err if e is not None and e.startswith("llm:")]
        n_failed = len(failed)
        first = failed[0][:200] if failed else None
        # downstream stages would index empty summaries: stop here; the next run retries the failed rows
        stop = (f"generate: {n_failed} generations failed in the LLM backend (first: {first}); check "
                "llm.backend/llm.base_url and re-run (finished sessions are kept)")
        return {"rows": mine.num_rows, "prompt_tokens": int(pc.sum(mine["prompt_tokens"]).as_py() or 0),
                "completion_tokens": int(pc.sum(mine["completion_tokens"]).as_py() or 0),
                "errors": sum(e is not None for e in err), "llm_failures": n_failed, "first_error": first,
                "fallbacks": int(pc.sum(pc.is_valid(mine["fallback"])).as_py() or 0),
                "unfinished": n_failed, "stop": stop}


def _item_hashes(unit: dict[str, Any]) -> list[str]:
    return [it[0] for it in unit["items"]]

"""The encode stage: every text the index and the questions need, embedded once per encoder key."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import Stage, StageContext, short_hash, table_digest
from memgas.jobs.stages.fields import ENCODER_OUTPUT_FIELDS, present_fields
from memgas.jobs.stages.justmem import justmem_enabled, justmem_texts
from memgas.jobs.stages.keys import (
    encoder_config,
    encoder_key,
    encoder_keys,
    justmem_upstream,
    window_key,
)
from memgas.jobs.stages.placement import encoder_on_cuda, model_gpus
from memgas.jobs.stages.texts import TextBlocks, rederive_texts, unit_texts
from memgas.jobs.stages.units import cost_chunks
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError


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
        return present_fields(cfg, ENCODER_OUTPUT_FIELDS)

    def fingerprint(self, ctx: StageContext) -> str:
        fp = super().fingerprint(ctx)
        e = ctx.cfg.encoder
        windows = {"pair": e.pair_max_tokens, "session": e.session_max_tokens}
        fp = fp if not any(windows.values()) else short_hash([fp, "windows", windows])
        # cards and plans are upstream only when JustMem is selected: without it the fingerprint is as before
        return fp if not justmem_enabled(ctx.cfg) else short_hash([fp, "justmem", justmem_upstream(ctx)])

    def resolved_inputs(self, ctx: StageContext) -> dict[str, Any]:
        return {"encoder": ctx.resolved.get("encoder"),
                "encoder_files": (ctx.resolved.get("model_files") or {}).get("encoder")}

    def model_config(self, ctx: StageContext) -> dict[str, Any]:
        return {"encoder": encoder_config(ctx)}

    def num_gpus(self, ctx: StageContext) -> float:
        return model_gpus(ctx, encoder_on_cuda(ctx))

    def actor_count(self, ctx: StageContext) -> int:
        """``encoder.actors``; auto on CUDA: ``ray.model_actors`` (auto on CPU fits one core)."""
        return ctx.cfg.encoder.actors if ctx.cfg.encoder.actors is not None else ctx.cfg.ray.model_actors

    def fits_one_core(self, ctx: StageContext) -> bool:
        """Auto actors (``encoder.actors`` unset) on a CPU encoder: one single-threaded actor per CPU."""
        return ctx.cfg.encoder.actors is None and ctx.resolved.get("encoder", {}).get("device", "cpu") == "cpu"

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
        texts = unit_texts(ctx, "encode:texts", unit, unit["hashes"])
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

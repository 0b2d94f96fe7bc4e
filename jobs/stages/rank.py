"""The rank stage: every query ranked by every retrieval method."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs.stage import StageContext, short_hash
from memgas.jobs.stages.justmem import current_cards, current_plans, justmem_enabled
from memgas.jobs.stages.keys import encoder_key, justmem_upstream
from memgas.jobs.stages.shards import (
    HistoryShardStage,
    matrix_loader,
    node_matrix,
    owned,
)
from memgas.jobs.stages.units import drop_other_parts, parts_with_prefix, prefix_of
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import BankError

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
                     "retrieval.router", "retrieval.ppr", "retrieval.ppr_epsilon", "retrieval.store_top",
                     "retrieval.device", *JUSTMEM_RANK_FIELDS)
    store = "results"
    check_table = "rankings"
    outputs = ("rankings", "card_picks")
    part_prefix = "rank"

    def active_fields(self, cfg: MemgasConfig) -> tuple[str, ...]:
        from memgas.pipeline.methods import uses_justmem

        base = tuple(f for f in self.config_fields if f not in JUSTMEM_RANK_FIELDS)
        if cfg.retrieval.ppr != "push":  # the push threshold changes nothing under the exact kernel
            base = tuple(f for f in base if f != "retrieval.ppr_epsilon")
        return (*base, *JUSTMEM_RANK_FIELDS) if uses_justmem(cfg.retrieval.methods) else base

    def fingerprint(self, ctx: StageContext) -> str:
        fp = super().fingerprint(ctx)
        # as in EncodeStage.fingerprint: the cards and plans are upstream only when JustMem is selected
        return fp if not justmem_enabled(ctx.cfg) else short_hash([fp, "justmem", justmem_upstream(ctx)])

    def params(self, ctx: StageContext) -> dict[str, Any]:
        return {"retrieval": ctx.cfg.retrieval.model_dump(), "justmem": ctx.cfg.justmem.model_dump(),
                **self.resolved_inputs(ctx)}

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        bank, ids = ctx.bank, unit["histories"]
        queries = bank.read("queries", ["query_id", "history_id", "question"], filter=pc.field("history_id").isin(ids))
        # in id order, not the files' order: a history's questions are ranked as one batch, whose float
        # sums depend on the rows' order (the same data ingested in another order gives the same bits)
        queries = queries.sort_by("query_id")
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
                              router=r["router"], device=device, ppr=r["ppr"],
                              ppr_epsilon=r["ppr_epsilon"]) if memgas else {}
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

"""The rank stage: every query ranked by every MemGAS retrieval method (JustMem's are the card ranker's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from memgas.jobs import tables
from memgas.jobs.keys import encoder_key
from memgas.jobs.stage import Active, StageContext
from memgas.jobs.stages.ranked import RankedShardStage, kept_parts, ranked_table
from memgas.jobs.stages.shards import matrix_loader, node_matrix, owned
from memgas.kernels.backend import one_blas_thread
from memgas.pipeline.bank import Bank
from memgas.pipeline.errors import BankError

#: kept per history across appends (:mod:`memgas.jobs.stages.ranked`): what each part's histories were ranked
#: from, and their rankings
RANKED = tables.Table("ranked_histories", "segmented", "results", current=kept_parts("ranked_histories"))
RANKINGS = tables.Table("rankings", "segmented", "results", current=kept_parts("ranked_histories"))


def family_methods(methods: list[str], family: str) -> list[str]:
    """The methods of ``methods`` scored by ``family`` ("memgas": node matrices; "justmem": cards), in order."""
    from memgas.pipeline.methods import get_method

    return [m for m in methods if get_method(m).family == family]


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


def family_ranker_active(active: Active, fields: tuple[str, ...], ctx: StageContext, methods: list[str]) -> Active:
    """A graph ranker's activity: its family's subset of retrieval.methods keys its rankings (a method of another
    family added changes nothing) and the push threshold changes nothing under the exact kernel."""
    unused = ("retrieval.methods",) + (("retrieval.ppr_epsilon",) if ctx.cfg.retrieval.ppr != "push" else ())
    active.fields = tuple(f for f in fields if f not in unused)
    active.resolved["methods"] = methods
    active.params["retrieval"] = {**ctx.cfg.retrieval.model_dump(), "methods": methods}
    return active


class RankStage(RankedShardStage):
    """Per shard of histories: every query ranked by every MemGAS method (router + seeds + batched PPR).
    The JustMem methods are the card ranker's (:class:`memgas.jobs.stages.justmem.CardRankStage`): which of
    them are selected, and their settings, change nothing here. Only the histories whose questions or nodes
    changed since the run directory's last answer are ranked (:mod:`memgas.jobs.stages.ranked`)."""

    name = "rank"
    version = "2"  # parts per shard of changed histories, named by config (version 1: by fingerprint)
    reads = ("queries", "nodes", "node_vectors", "edges")
    writes = (RANKED, RANKINGS)
    fields = ("retrieval.methods", "retrieval.num_seeds", "retrieval.damping", "retrieval.temp", "retrieval.router",
              "retrieval.ppr", "retrieval.ppr_epsilon", "retrieval.store_top", "retrieval.device")

    def active(self, ctx: StageContext) -> Active | None:
        methods = family_methods(ctx.cfg.retrieval.methods, "memgas")
        if not methods:
            return None
        return family_ranker_active(super().active(ctx), self.fields, ctx, methods)

    def history_tables(self, ctx: StageContext, queries: pa.Table) -> dict[str, pa.Table]:
        """A history's questions and its nodes (the vectors and edges of a history follow from its nodes and
        the keys of the encoder and the associate stage)."""
        return {"queries": queries, "nodes": tables.read_current(ctx, "nodes")}

    def shard_inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        bank, ids = ctx.bank, unit["histories"]
        queries = bank.read("queries", ["query_id", "history_id", "question"], filter=pc.field("history_id").isin(ids))
        # in id order, not the files' order: a history's questions are ranked as one batch, whose float
        # sums depend on the rows' order (the same data ingested in another order gives the same bits)
        queries = queries.sort_by("query_id")
        if queries.num_rows == 0:
            return {"histories": []}
        loader = matrix_loader(ctx, ids)
        all_edges = edges_of(bank, ids, tables.current_parts(ctx, "edges"))
        qdf = queries.to_pandas()
        qv = query_vectors(bank, qdf["question"].tolist(), encoder_key(ctx))
        out = []
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        for h, g in qdf.groupby("history_id", sort=True):
            if h not in loader.history_ids:
                continue
            out.append({"history_id": h, "matrices": loader.get(h), "query_ids": g["query_id"].tolist(),
                        "queries": qv[g.index.to_numpy()],
                        "edges": {mode: all_edges.get((h, mode), empty) for mode in ("gmm", "topk")}})
        return {"histories": out}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        from memgas.pipeline.schema import RANKINGS as SCHEMA

        r = params["retrieval"]
        cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
        with one_blas_thread():
            ranked_all = [RankStage.rank_one(h, r, params["device"]) for h in payload["histories"]]
        for h, (m, ranked) in zip(payload["histories"], ranked_all):
            ranking_rows(cols, m["session_ids"], h["query_ids"], ranked, r["store_top"])
        return {"rankings": pa.table(cols, schema=SCHEMA), "ranked_histories": ranked_table(payload)}

    @staticmethod
    def rank_one(h: dict[str, Any], r: dict[str, Any], device: str) -> tuple[dict, dict]:
        """(matrices, {method: (order, scores)}) of the MemGAS methods ``r["methods"]`` from the node matrices."""
        from memgas.pipeline.retrieve import rank_history

        m = {k: (owned(v, np.float32) if isinstance(v, np.ndarray) else v) for k, v in h["matrices"].items()}
        edges = {mode: (owned(src, np.int64), owned(dst, np.int64)) for mode, (src, dst) in h["edges"].items()}
        ranked = rank_history(node_matrix(m), owned(h["queries"], np.float32), edges, r["methods"],
                              hybrid=m.get("hybrid"), num_seeds=r["num_seeds"], damping=r["damping"], temp=r["temp"],
                              router=r["router"], device=device, ppr=r["ppr"], ppr_epsilon=r["ppr_epsilon"])
        return m, {x: ranked[x] for x in r["methods"]}


def ranking_rows(cols: dict[str, list], session_ids: list[str], query_ids: list[str], ranked: dict[str, tuple],
                 store_top: int) -> None:
    """Append the top ``store_top`` of each method's ranking of each query to ``cols`` (``rankings`` columns)."""
    sids = np.asarray(session_ids, dtype=object)
    top = min(store_top, len(sids))
    for method, (order, scores) in ranked.items():
        for qi, qid in enumerate(query_ids):
            o = order[qi, :top]
            cols["method"] += [method] * top
            cols["query_id"] += [qid] * top
            cols["rank"] += list(range(1, top + 1))
            cols["session_id"] += sids[o].tolist()
            cols["score"] += scores[qi, o].astype(float).tolist()

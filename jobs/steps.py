"""CPU steps that run as Ray tasks over shards of histories: association and ranking.

Each takes ``(history_ids, context)`` and returns an Arrow table; the executor writes it as a bank part.
Tasks read the bank's tables themselves (embeddings are large; shipping them through the driver would
double the traffic), so on a cluster the bank must sit on a shared filesystem.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memgas.pipeline.bank import Bank
from memgas.pipeline.schema import EDGES, RANKINGS

log = logging.getLogger(__name__)

GRAPH_METHODS = ("memgas", "memgas-no-gmm", "memgas-no-ppr", "memgas-no-router", "memgas-no-association")
SINGLE_METHODS = ("session", "turn", "summary", "keyword", "hybrid")


def _node_matrix(m: dict[str, Any]) -> np.ndarray:
    from memgas.pipeline.retrieve import stack_nodes

    return stack_nodes(m["session"], m["turn"], m["summary"], m["keyword"])


def associate_shard(history_ids: list[str], ctx: dict[str, Any]) -> pa.Table:
    """GMM edges (and the top-k edges of the "no GMM" ablation) for every history of the shard."""
    from memgas.pipeline.association import associate_many
    from memgas.pipeline.granularity import MatrixLoader

    bank = Bank(ctx["bank"])
    a = ctx["association"]
    loader = MatrixLoader(bank, ctx["encoder"], history_ids=history_ids)
    ids = [h for h in history_ids if h in loader.history_ids]
    mats = [_node_matrix(loader.get(h)) for h in ids]
    device = _device(ctx.get("device", "cpu"))
    cols: dict[str, list] = {"history_id": [], "src": [], "dst": [], "similarity": [], "mode": []}
    for mode in ("gmm", "topk"):
        edges = associate_many(
            mats, mem_threshold=a["mem_threshold"], min_prior_nodes=a["min_prior_nodes"], mode=mode,
            topk_edges=a["topk_edges"], device=device, dense_max_nodes=a["dense_max_nodes"],
        )
        for h, e in zip(ids, edges):
            n = len(e.src)
            cols["history_id"] += [h] * n
            cols["src"] += e.src.tolist()
            cols["dst"] += e.dst.tolist()
            cols["similarity"] += e.sim.tolist()
            cols["mode"] += [mode] * n
    return pa.table(cols, schema=EDGES)


def _device(device: str) -> str:
    if device != "auto":
        return device
    from memgas.kernels.backend import get_xp

    return get_xp("auto")[1]


def _query_vectors(bank: Bank, questions: list[str], encoder: str) -> np.ndarray:
    from memgas.pipeline.encode import query_hash

    hashes = [query_hash(q) for q in questions]
    t = bank.read("embeddings", ["text_hash", "vector"],
                  filter=(pc.field("encoder") == encoder) & pc.field("text_hash").isin(sorted(set(hashes))))
    d = t.schema.field("vector").type.list_size
    vecs = t.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, d)
    row = {h: i for i, h in enumerate(t.column("text_hash").to_pylist())}
    missing = [q for q, h in zip(questions, hashes) if h not in row]
    if missing:
        from memgas.pipeline.errors import BankError

        raise BankError(f"{bank.path}: {len(missing)} questions have no '{encoder}' embedding "
                        f"(first: {missing[0][:60]!r}); run `memgas index`")
    return vecs[[row[h] for h in hashes]].astype(np.float32)


def rank_history(
    m: dict[str, Any], q: np.ndarray, edges: dict[str, tuple[np.ndarray, np.ndarray]], methods: list[str],
    r: dict[str, Any], device: str,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(order [Q, S], scores [Q, S]) per method for the queries ``q`` of one history."""
    from memgas.pipeline.retrieve import rank_sessions, score_with_edges

    out = {}
    nodes = _node_matrix(m)
    for method in methods:
        if method in SINGLE_METHODS:
            out[method] = rank_sessions(
                m["session"], m["turn"], m["summary"], m["keyword"], q, method=method, device=device,
                hybrid_emb=m.get("hybrid"), return_scores=True,
            )
        else:
            src, dst = edges["topk" if method == "memgas-no-gmm" else "gmm"]
            out[method] = score_with_edges(
                nodes, q, src, dst, method=method, num_seeds=r["num_seeds"], damping=r["damping"],
                temp=r["temp"], router=r["router"], device=device,
            )
    return out


def _edges_of(bank: Bank, history_ids: list[str]) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    t = bank.read("edges", filter=pc.field("history_id").isin(history_ids))
    out: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    if t.num_rows:
        df = t.to_pandas()
        for (h, mode), g in df.groupby(["history_id", "mode"], sort=False):
            out[(h, mode)] = (g["src"].to_numpy(np.int64), g["dst"].to_numpy(np.int64))
    return out


def rank_shard(history_ids: list[str], ctx: dict[str, Any]) -> pa.Table:
    """Rankings (top ``store_top`` sessions) of every query of the shard's histories, for every method."""
    from memgas.pipeline.granularity import MatrixLoader

    bank = Bank(ctx["bank"])
    r = ctx["retrieval"]
    device = _device(r.get("device", "cpu"))
    queries = bank.read("queries", ["query_id", "history_id", "question"], filter=pc.field("history_id").isin(history_ids))
    cols: dict[str, list] = {"method": [], "query_id": [], "rank": [], "session_id": [], "score": []}
    if queries.num_rows == 0:
        return pa.table(cols, schema=RANKINGS)
    loader = MatrixLoader(bank, ctx["encoder"], history_ids=history_ids)
    all_edges = _edges_of(bank, history_ids)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    qdf = queries.to_pandas()
    # one read of the shard's query vectors (not one scan of the embeddings table per history)
    all_qv = _query_vectors(bank, qdf["question"].tolist(), ctx["encoder"])
    for h, g in qdf.groupby("history_id", sort=True):
        if h not in loader.history_ids:
            continue
        m = loader.get(h)
        qv = all_qv[g.index.to_numpy()]
        edges = {mode: all_edges.get((h, mode), empty) for mode in ("gmm", "topk")}
        ranked = rank_history(m, qv, edges, r["methods"], r, device)
        sids = np.asarray(m["session_ids"], dtype=object)
        top = min(r["store_top"], len(sids))
        for method, (order, scores) in ranked.items():
            for qi, qid in enumerate(g["query_id"].tolist()):
                o = order[qi, :top]
                cols["method"] += [method] * top
                cols["query_id"] += [qid] * top
                cols["rank"] += list(range(1, top + 1))
                cols["session_id"] += sids[o].tolist()
                cols["score"] += scores[qi, o].astype(float).tolist()
    return pa.table(cols, schema=RANKINGS)


def reading_payloads(bank: Bank, results: Bank, method: str, cfg: Any) -> list[dict[str, Any]]:
    """Inputs of the reading stage: per query, its top-K sessions with date, text, summary, keywords."""
    from memgas.jobs.main_job import generator_identity

    queries = bank.read("queries", ["query_id", "history_id", "question", "question_date_raw"]).to_pandas()
    if cfg.reading.max_questions is not None:
        queries = queries.head(cfg.reading.max_questions)
    rk = results.read("rankings", filter=(pc.field("method") == method) & (pc.field("rank") <= cfg.reading.top_k)).to_pandas()
    rk = rk[rk["query_id"].isin(queries["query_id"])].sort_values(["query_id", "rank"])
    top = {q: g["session_id"].tolist() for q, g in rk.groupby("query_id")}
    sessions = bank.read("sessions", ["history_id", "session_id", "date_raw", "text_hash", "dataset_summary"]).to_pandas()
    sessions = sessions[sessions["history_id"].isin(queries["history_id"])]
    model, pv = generator_identity(cfg)
    hashes = sorted(set(sessions["text_hash"]))
    gens = bank.read("generations", ["text_hash", "kind", "output"],
                     filter=(pc.field("model") == model) & (pc.field("prompt_version") == pv) & pc.field("text_hash").isin(hashes)).to_pandas()
    gen = {(h, k): o for h, k, o in gens.itertuples(index=False)}
    texts = bank.read("texts", filter=pc.field("text_hash").isin(hashes)).to_pandas()
    text = dict(zip(texts["text_hash"], texts["text"]))
    info = {(r.history_id, r.session_id): r for r in sessions.itertuples(index=False)}
    payload = []
    for q in queries.itertuples(index=False):
        sess = []
        for sid in top.get(q.query_id, []):
            s = info[(q.history_id, sid)]
            sess.append({"session_id": sid, "date": s.date_raw, "text": text.get(s.text_hash, ""),
                         "summary": gen.get((s.text_hash, "summary"), ""), "keywords": gen.get((s.text_hash, "keywords"), "")})
        payload.append({"query_id": q.query_id, "question": q.question, "question_date": q.question_date_raw, "sessions": sess})
    return payload


def ranking_latency(bank: Bank, cfg: Any, *, n_queries: int = 30, method: str = "memgas") -> dict[str, float]:
    """Latency of ranking one query at a time (router + seeds + PPR on its history's stored graph)."""
    from memgas.jobs.main_job import encoder_name
    from memgas.jobs.profiling import percentiles_ms
    from memgas.pipeline.granularity import MatrixLoader

    queries = bank.read("queries", ["query_id", "history_id", "question"]).to_pandas().head(n_queries)
    if queries.empty:
        return {}
    hids = sorted(set(queries["history_id"]))
    enc = encoder_name(cfg)
    loader = MatrixLoader(bank, enc, history_ids=hids)
    edges = _edges_of(bank, hids)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    r = cfg.retrieval.model_dump()
    device = _device(r["device"])
    mats = {h: loader.get(h) for h in hids if h in loader.history_ids}
    samples = []
    for q in queries.itertuples(index=False):
        if q.history_id not in mats:
            continue
        qv = _query_vectors(bank, [q.question], enc)
        e = {mode: edges.get((q.history_id, mode), empty) for mode in ("gmm", "topk")}
        t0 = time.perf_counter()
        rank_history(mats[q.history_id], qv, e, [method], r, device)
        samples.append(time.perf_counter() - t0)
    return percentiles_ms(samples)

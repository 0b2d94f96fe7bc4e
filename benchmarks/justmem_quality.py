"""JustMem retrieval quality on LoCoMo or LongMemEval (LLM-free cards and planner, MiniLM on CPU) vs the
``session`` method.

    .venv/bin/python benchmarks/justmem_quality.py [--data data/sample/locomo_sample.json] [--json out.json]
    .venv/bin/python benchmarks/justmem_quality.py --format longmemeval --data ../shared/data/longmemeval/longmemeval_s_sample.json

Ingests the file into a temporary bank with the real loader, extracts cards with the LLM-free extractor,
plans every question with the LLM-free planner, encodes session texts, card texts, questions and rewrites
with MiniLM (sentence-transformers, torch runtime, CPU: the same vectors as tests/fixtures), ranks the
sessions of each history by ``session`` (question . session text vector, what the pipeline's ``session``
method does) and by the JustMem methods, and prints session-level R_all@3/5/10 and NDCG@10 (LongMemEval's
definitions, pipeline/evaluate/retrieval.py; abstention and no-evidence questions skipped), the cards'
statistics (with the encoder input tokens of the unique card texts and plan rewrites, counted as the
encode stage counts them), and how the profiles fall over the question categories. ``--merge-chars`` /
``--assistant-chars``: the LLM-free extractor's alternatives (``extract_llm_free``) against its defaults.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = ("cards", "justmem-lookup", "justmem-compose", "justmem-replay", "justmem")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / "data" / "sample" / "locomo_sample.json"))
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--set", action="append", default=[], help="justmem.* overrides, e.g. justmem.top_k=5")
    ap.add_argument("--format", default="locomo", choices=("locomo", "longmemeval"))
    ap.add_argument("--no-session", action="store_true",
                    help="skip the session row (LongMemEval sessions are long: encoding them costs time)")
    ap.add_argument("--merge-chars", type=int, default=None, help="extract_llm_free(merge_chars=...)")
    ap.add_argument("--assistant-chars", type=int, default=None, help="extract_llm_free(assistant_chars=...)")
    ap.add_argument("--cache", default=None, help="directory keeping the vectors between runs (texts.json + "
                    "vectors.npy): only texts not in it are encoded")
    args = ap.parse_args()

    from memgas.pipeline.bank import Bank
    from memgas.pipeline.config import EncoderConfig, MemgasConfig
    from memgas.pipeline.evaluate.retrieval import score_retrieval
    from memgas.pipeline.ingest import ingest
    import pyarrow as pa

    from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR, card_rows, extract_llm_free, turns_by_session
    from memgas.pipeline.schema import CARDS
    from memgas.pipeline.justmem.plan import planner_key, plan_queries, plans_from_table
    from memgas.pipeline.justmem.retrieve import HistoryCards, rank_cards
    from memgas.pipeline.models.factory import make_encoder

    cfg = MemgasConfig.load(None, [s if s.startswith("justmem.") else f"justmem.{s}" for s in args.set]).justmem
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="justmem-bench-")
    ingest(args.data, args.format, Path(tmp) / "bank", progress=False)
    bank = Bank(Path(tmp) / "bank")
    sessions = bank.read("sessions").to_pandas().sort_values(["history_id", "position"])
    texts = dict(zip(*[bank.read("texts").column(c).to_pylist() for c in ("text_hash", "text")]))
    turns = turns_by_session(bank.read("turns"))
    queries = bank.read("queries").to_pandas()

    t1 = time.perf_counter()
    unique = sorted(turns)
    alt = {k: v for k, v in (("merge_chars", args.merge_chars), ("assistant_chars", args.assistant_chars))
           if v is not None}
    cards = pa.Table.from_pylist([r for h in unique for r in card_rows(h, LLM_FREE_EXTRACTOR,
                                                                        extract_llm_free(turns[h], **alt))],
                                 schema=CARDS)
    extract_s = time.perf_counter() - t1
    plans_t = plan_queries(list(zip(queries.query_id, queries.question, queries.question_date_raw)), cfg,
                           key=planner_key(cfg))
    plans = plans_from_table(plans_t)

    enc = make_encoder(EncoderConfig(device="cpu", runtime="torch"))
    card_texts = sorted(set(cards.column("text").to_pylist()))
    rewrites = sorted({r for p in plans.values() for r in p.rewrites})
    sess_texts = [] if args.no_session else sorted({texts[h] for h in sessions.text_hash})
    t2 = time.perf_counter()
    allv = _encode(enc, card_texts + sess_texts + list(queries.question) + rewrites, args.cache)
    encode_s = time.perf_counter() - t2
    a, b, c = len(card_texts), len(card_texts) + len(sess_texts), len(card_texts) + len(sess_texts) + len(queries)
    vec = dict(zip(card_texts, allv[:a]))
    svec = dict(zip(sess_texts, allv[a:b]))
    qvec = dict(zip(queries.query_id, allv[b:c]))
    rvec = dict(zip(rewrites, allv[c:]))
    from memgas.pipeline.hashing import text_hash
    by_hash = {text_hash(t): v for t, v in vec.items()}

    records: dict[str, list[dict]] = collections.defaultdict(list)
    profiles_by_cat: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for hid, sess in sessions.groupby("history_id", sort=True):
        sids = list(sess.session_id)
        hashes = list(sess.text_hash)
        hc = HistoryCards.from_table(hashes, cards.filter(_isin(cards, "session_hash", hashes)), by_hash,
                                     list(sess.date))
        q = queries[queries.history_id == hid]
        Q = np.stack([qvec[i] for i in q.query_id])
        pl = [plans[i] for i in q.query_id]
        rv = [np.stack([rvec[r] for r in p.rewrites]) if p.rewrites else None for p in pl]
        ranked = {}
        if not args.no_session:
            S = np.stack([svec[texts[h]] for h in hashes])
            ranked["session"] = np.argsort(-(Q.astype(np.float64) @ S.astype(np.float64).T), axis=1, kind="stable")
        for m in METHODS:
            sel = rank_cards(hc, list(q.question), Q, m, cfg, plans=pl, rewrite_vecs=rv,
                             question_dates=list(q.question_date))
            ranked[m] = sel.order
            if m == "justmem":
                for cat, prof in zip(q.question_type, sel.profiles):
                    profiles_by_cat[cat][prof] += 1
        for m, order in ranked.items():
            for row, o in zip(q.itertuples(index=False), order):
                records[m].append({"query_id": row.query_id, "ranked_ids": [sids[k] for k in o],
                                   "evidence_ids": list(row.evidence_session_ids), "is_abstention": row.is_abstention,
                                   "question_type": row.question_type})

    out: dict = {"data": str(args.data), "justmem": cfg.model_dump(), "methods": {}}
    print(f"data: {args.data}  histories: {sessions.history_id.nunique()}  sessions: {len(unique)}  "
          f"questions: {len(queries)}")
    n_cards = cards.num_rows
    chars = np.array([len(t) for t in cards.column("text").to_pylist()])
    types = collections.Counter(cards.column("type").to_pylist())
    print(f"cards ({LLM_FREE_EXTRACTOR}): {n_cards} = {n_cards / len(unique):.1f} per session, "
          f"{chars.mean():.0f} chars per card (median {int(np.median(chars))}), types {dict(sorted(types.items()))}; "
          f"extraction {extract_s:.2f}s = {1000 * extract_s / len(unique):.1f}s per 1,000 sessions")
    print(f"encode: {len(allv)} texts in {encode_s:.1f}s")
    tok = {"card": _input_tokens(enc, card_texts), "plan rewrite": _input_tokens(enc, rewrites)}
    print(f"encoder input tokens: cards {tok['card']:,} ({len(card_texts):,} unique texts), "
          f"plan rewrites {tok['plan rewrite']:,}")
    out["tokens"] = tok
    out["cards"] = {"n": n_cards, "per_session": n_cards / len(unique), "chars_mean": float(chars.mean()),
                    "chars_median": float(np.median(chars)), "types": dict(types), "extract_s": extract_s}
    print("\n| method | R_all@3 | R_all@5 | R_all@10 | NDCG@10 | questions |\n|---|---|---|---|---|---|")
    for m in ("session", *METHODS) if not args.no_session else METHODS:
        df, _skipped = score_retrieval(records[m], ks=(3, 5, 10))
        row = {k: float(df[k].mean()) for k in ("recall_all@3", "recall_all@5", "recall_all@10", "ndcg@10")}
        out["methods"][m] = {**row, "n": len(df)}
        print(f"| {m} | {row['recall_all@3']:.4f} | {row['recall_all@5']:.4f} | {row['recall_all@10']:.4f} | "
              f"{row['ndcg@10']:.4f} | {len(df)} |")
    print("\nprofiles (adaptive justmem, LLM-free planner) per question type:")
    for cat, cnt in sorted(profiles_by_cat.items()):
        print(f"  {cat}: {dict(sorted(cnt.items()))}")
    out["profiles"] = {k: dict(v) for k, v in profiles_by_cat.items()}
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True))
    return 0


def _input_tokens(enc, texts: list[str]) -> int:  # noqa: ANN001 - a memgas encoder
    """Tokens of the encoder's model inputs for ``texts`` (special tokens included, every window counted), as
    the ``embeddings`` table's ``tokens`` column counts them."""
    prefix, suffix = enc._special_wrap()
    window = enc.max_tokens - len(prefix) - len(suffix)
    total = 0
    for n in (int(x) for x in enc.count_tokens(texts)) if texts else ():
        pieces = 1 if n <= window or enc.long_text == "truncate" else -(-n // window)
        total += min(n, window) + len(prefix) + len(suffix) if pieces == 1 else n + pieces * (len(prefix) + len(suffix))
    return total


def _encode(enc, texts: list[str], cache: str | None) -> np.ndarray:  # noqa: ANN001 - an encoder
    """Vectors of ``texts``; with ``cache``, those of texts encoded by an earlier run are read back."""
    if cache is None:
        return enc.encode(texts)
    d = Path(cache)
    known: dict[str, np.ndarray] = {}
    if (d / "texts.json").exists():
        known = dict(zip(json.loads((d / "texts.json").read_text()), np.load(d / "vectors.npy")))
    todo = sorted({t for t in texts if t not in known})
    if todo:
        known.update(zip(todo, enc.encode(todo)))
        d.mkdir(parents=True, exist_ok=True)
        names = sorted(known)
        np.save(d / "vectors.npy", np.stack([known[t] for t in names]))
        (d / "texts.json").write_text(json.dumps(names))
    return np.stack([known[t] for t in texts])


def _isin(table, col, values):  # noqa: ANN001, ANN202 - a pyarrow mask
    import pyarrow.compute as pc

    return pc.is_in(table.column(col), value_set=__import__("pyarrow").array(values))


if __name__ == "__main__":
    sys.exit(main())

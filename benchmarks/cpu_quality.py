"""LoCoMo retrieval quality of CPU index settings (generator method x encoder runtime x long-text mode).

Calls the pipeline's library functions directly (loader -> LLM-free generator -> encoder -> rank_sessions ->
score_retrieval), not the job runner, so each setting costs only what differs: vectors are cached per
(encoder name, text) in memory and in ``--cache`` (an .npz per encoder), generator outputs per setting.

    python benchmarks/cpu_quality.py [--data ../shared/data/locomo/locomo10.json]
        [--gens old,tfidf,...] [--encs torch:truncate,onnx-int8:truncate,...] [--methods all]

``--format longmemeval`` reads a LongMemEval file instead (the 22-question S sample, or the oracle questions
with distractor sessions that ``--make-lme-mix`` writes). Encoder settings may end in ``:pwN``: turn pairs
encoded with an N-token window (``encoder.pair_max_tokens``), every other text with the model's window; and
in ``:swN``: session texts with an N-token window; and in ``:mtN``: every text with an N-token window
(``encoder.max_tokens``; pairs and sessions too unless ``:pwN`` / ``:swN`` is given).

Generator settings (``--gens``, see ``GENS``): ``old`` = YAKE + encoder-centroid summaries at the previous
sizes (10 keywords, 3 sentences / 600 chars; sentences embedded by torch fp32 MiniLM); ``tfidf`` = the new
methods at the old sizes; ``tfidf12-kw30`` = the new default (12 sentences / 1200 chars, 30 keyphrases);
mixes and size variants; ``dataset`` = LoCoMo's GPT session summaries + default tf-idf keywords. Encoder settings (``--encs``): ``runtime:long_text`` with runtime in torch, onnx, onnx-int8.
Prints one Markdown table: R_all@3/5/10 per method per setting, plus generation s/session, the max
cosine difference of each runtime's vectors against torch fp32, and encoded tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo10.json"
METHODS = ("session", "turn", "summary", "keyword", "hybrid", "memgas", "memgas-no-gmm", "memgas-no-ppr",
           "memgas-no-router", "memgas-no-association")

OLD_SIZES = {"summary_sentences": 3, "max_summary_chars": 600, "top_keywords": 10}  # the previous defaults
GENS = {
    # name: (keyword_method, summary_method, kwargs); "tfidf" alone = the new methods at the old sizes
    "old": ("yake", "centroid", OLD_SIZES),
    "tfidf": ("tfidf", "tfidf", OLD_SIZES),
    "yake+tfidf": ("yake", "tfidf", OLD_SIZES),
    "tfidf+centroid": ("tfidf", "centroid", OLD_SIZES),
    "tfidf+lead": ("tfidf", "lead", OLD_SIZES),
    "tfidf5": ("tfidf", "tfidf", {**OLD_SIZES, "summary_sentences": 5, "max_summary_chars": 1000}),
    "tfidf-nommr": ("tfidf", "tfidf", {**OLD_SIZES, "mmr": 0.0}),
    "tfidf8": ("tfidf", "tfidf", {**OLD_SIZES, "summary_sentences": 8, "max_summary_chars": 1000}),
    "tfidf5-kw20": ("tfidf", "tfidf", {"summary_sentences": 5, "max_summary_chars": 1000, "top_keywords": 20}),
    "tfidf5-kw5": ("tfidf", "tfidf", {"summary_sentences": 5, "max_summary_chars": 1000, "top_keywords": 5}),
    "yake+tfidf5": ("yake", "tfidf", {**OLD_SIZES, "summary_sentences": 5, "max_summary_chars": 1000}),
    "tfidf8-kw20": ("tfidf", "tfidf", {"summary_sentences": 8, "max_summary_chars": 1000, "top_keywords": 20}),
    # the new default (LLMFreeGenerator())
    "tfidf12-kw30": ("tfidf", "tfidf", {"summary_sentences": 12, "max_summary_chars": 1200, "top_keywords": 30}),
    "yake30+tfidf12": ("yake", "tfidf", {"summary_sentences": 12, "max_summary_chars": 1200, "top_keywords": 30}),
    "dataset": ("tfidf", "dataset", {}),
}


LME_DIR = ROOT.parent / "shared" / "data" / "longmemeval"


def make_lme_mix(out: Path, distractors: int = 40, seed: int = 0) -> None:
    """A LongMemEval retrieval probe with 500 questions: each oracle question's evidence sessions plus
    ``distractors`` sessions drawn (fixed seed) from the non-evidence haystack sessions of the 22-question S
    sample, in date order. Easier than LongMemEval-S (the distractors come from other users' haystacks), but
    real LongMemEval sessions and questions, enough of them to compare settings."""
    import json
    import random

    oracle = json.loads((LME_DIR / "longmemeval_oracle.json").read_text())
    sample = json.loads((LME_DIR / "longmemeval_s_sample.json").read_text())
    pool: dict[str, tuple[str, list[dict]]] = {}
    for q in sample:
        for sid, date, sess in zip(q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"]):
            if not sid.startswith("answer_"):
                pool[sid] = (date, [{k: v for k, v in t.items() if k != "has_answer"} for t in sess])
    ids = sorted(pool)
    rng = random.Random(seed)
    mixed = []
    for q in oracle:
        evidence = set(q["answer_session_ids"])
        items = list(zip(q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"]))
        items += [(i, *pool[i]) for i in rng.sample(ids, distractors) if i not in evidence]
        items.sort(key=lambda x: x[1])  # "2023/05/21 (Sun) 19:50" sorts by date as text
        mixed.append({**q, "haystack_session_ids": [x[0] for x in items], "haystack_dates": [x[1] for x in items],
                      "haystack_sessions": [x[2] for x in items]})
    out.write_text(json.dumps(mixed))
    print(f"wrote {out}: {len(mixed)} questions, {sum(len(m['haystack_sessions']) for m in mixed)} session references")


def load_records(path: Path, fmt: str = "locomo"):
    """Every history of a LoCoMo or LongMemEval file, through the pipeline's own loaders."""
    from memgas.pipeline.data.common import Warnings

    if fmt == "longmemeval":
        from memgas.pipeline.data.longmemeval import load
    else:
        from memgas.pipeline.data.locomo import load
    return list(load(path, Warnings(str(path))))


class VecCache:
    """Vectors per (encoder name, text hash), persisted per encoder in ``cache_dir``."""

    def __init__(self, cache_dir: Path | None) -> None:
        self.dir = cache_dir
        self.mem: dict[str, dict[str, np.ndarray]] = {}
        self.tokens: dict[str, int] = {}

    def _file(self, name: str) -> Path | None:
        if self.dir is None:
            return None
        return self.dir / (hashlib.sha1(name.encode()).hexdigest()[:16] + ".npz")

    def get(self, enc, texts: list[str]) -> np.ndarray:
        from memgas.pipeline.encode import encode_texts

        name = enc.name
        d = self.mem.setdefault(name, {})
        f = self._file(name)
        if not d and f is not None and f.exists():
            z = np.load(f)
            d.update({k: z[k] for k in z.files})
        keys = [hashlib.sha1(t.encode()).hexdigest() for t in texts]
        todo = sorted({k: t for k, t in zip(keys, texts) if k not in d}.items())
        if todo:
            res = encode_texts(enc, [t for _, t in todo])
            for (k, _), v in zip(todo, res.vectors):
                d[k] = v
            self.tokens[name] = self.tokens.get(name, 0) + res.total_tokens
            if f is not None:
                f.parent.mkdir(parents=True, exist_ok=True)
                np.savez(f, **d)
        return np.stack([d[k] for k in keys]) if keys else np.zeros((0, enc.dim), np.float32)


def generate(records, gen: str, centroid_encoder) -> tuple[dict[str, tuple[str, str]], float]:
    """session text_hash -> (summary, keywords) for every session; seconds per session."""
    from memgas.pipeline.llm_free import LLMFreeGenerator

    kw_m, sum_m, kw = GENS[gen]
    g = LLMFreeGenerator(centroid_encoder if sum_m == "centroid" else None, keyword_method=kw_m,
                         summary_method="tfidf" if sum_m == "dataset" else sum_m, **kw)
    sess = {}
    dsum = {}
    for r in records:
        for s in r.sessions:
            sess[s["text_hash"]] = r.texts[s["text_hash"]]
            dsum[s["text_hash"]] = s.get("dataset_summary") or ""
    hashes = sorted(sess)
    texts = [sess[h] for h in hashes]
    t0 = time.perf_counter()
    kws = g.keywords(texts)
    sums = [dsum[h] for h in hashes] if sum_m == "dataset" else g.summaries(texts)
    dt = time.perf_counter() - t0
    return {h: (s, k) for h, s, k in zip(hashes, sums, kws)}, dt / max(len(hashes), 1)


def evaluate(records, gens: dict[str, tuple[str, str]], enc, cache: VecCache, methods,
             pair_enc=None, session_enc=None) -> dict[str, dict[str, float]]:
    """R_all@3/5/10 per method. ``pair_enc`` / ``session_enc``: the encoder of turn-pair / session texts when
    it differs (a shorter window); every other text goes through ``enc``."""
    pair_enc = pair_enc or enc
    session_enc = session_enc or enc
    from memgas.pipeline.evaluate.retrieval import aggregate_retrieval, score_retrieval
    from memgas.pipeline.generate import hybrid_text
    from memgas.pipeline.retrieve import rank_sessions

    recs_by_method: dict[str, list[dict]] = {m: [] for m in methods}
    # every text of every history through each encoder once, in one call (long length-sorted batches)
    main_texts, pair_texts, session_texts = [], [], []
    for r in records:
        for s in r.sessions:
            h = s["text_hash"]
            session_texts.append(r.texts[h])
            main_texts += [gens[h][0], gens[h][1], hybrid_text(gens[h][0], gens[h][1], r.texts[h])]
        main_texts += [q["question"] for q in r.queries]
        pair_texts += [r.texts[p["text_hash"]] for p in r.pairs]
    cache.get(enc, sorted(set(main_texts)))
    cache.get(pair_enc, sorted(set(pair_texts)))
    cache.get(session_enc, sorted(set(session_texts)))
    for r in records:
        sh = [s["text_hash"] for s in r.sessions]
        stext = [r.texts[h] for h in sh]
        summ = [gens[h][0] for h in sh]
        kws = [gens[h][1] for h in sh]
        hyb = [hybrid_text(a, b, c) for a, b, c in zip(summ, kws, stext)]
        pairs_by_sess: dict[str, list[str]] = {}
        for p in r.pairs:
            pairs_by_sess.setdefault(p["session_hash"], []).append(r.texts[p["text_hash"]])
        S = cache.get(session_enc, stext)
        Y = cache.get(enc, summ)
        K = cache.get(enc, kws)
        H = cache.get(enc, hyb)
        T = np.stack([cache.get(pair_enc, pairs_by_sess[h]).mean(0) if pairs_by_sess.get(h) else S[i]
                      for i, h in enumerate(sh)]).astype(np.float32)
        qs = [q for q in r.queries]
        Q = cache.get(enc, [q["question"] for q in qs])
        sids = [s["session_id"] for s in r.sessions]
        for m in methods:
            order = rank_sessions(S, T, Y, K, Q, method=m, device="cpu", hybrid_emb=H)
            for q, o in zip(qs, order):
                recs_by_method[m].append({"query_id": q["query_id"], "ranked_ids": [sids[i] for i in o],
                                          "evidence_ids": q["evidence_session_ids"],
                                          "is_abstention": q["is_abstention"], "question_type": q["question_type"]})
    out = {}
    for m, recs in recs_by_method.items():
        df, _ = score_retrieval(recs, ks=(3, 5, 10))
        agg = aggregate_retrieval(df).loc["overall"]
        out[m] = {k: 100 * float(agg[f"recall_all@{k}"]) for k in (3, 5, 10)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--format", default="locomo", choices=("locomo", "longmemeval"))
    ap.add_argument("--gens", default="old,tfidf")
    ap.add_argument("--encs", default="torch:truncate,onnx-int8:truncate")
    ap.add_argument("--methods", default="all")
    ap.add_argument("--cache", default="/tmp/memgas-bench-vectors", help="vector cache folder ('' = none)")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations")
    ap.add_argument("--make-lme-mix", metavar="OUT", default=None,
                    help="write the LongMemEval oracle+distractors probe file to OUT and exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.make_lme_mix:
        make_lme_mix(Path(args.make_lme_mix))
        return

    from memgas.pipeline.models.encoders import SentenceTransformerEncoder

    records = load_records(Path(args.data), args.format)[: args.limit]
    methods = METHODS if args.methods == "all" else tuple(args.methods.split(","))
    cache = VecCache(Path(args.cache) if args.cache else None)
    encs, pair_encs, session_encs = {}, {}, {}
    for spec in args.encs.split(","):
        # runtime:long_text[:pwN][:swN][:mtN]: N = max tokens of turn-pair texts (pw), of session texts
        # (sw), of every text (mt)
        rt, lt, *opts = spec.split(":")
        windows = {o[:2]: int(o[2:]) for o in opts}
        if set(windows) - {"pw", "sw", "mt"}:
            raise SystemExit(f"--encs {spec}: options are pwN, swN and mtN")
        encs[spec] = SentenceTransformerEncoder("minilm", device="cpu", runtime=rt, long_text=lt,
                                                max_tokens=windows.get("mt"))
        if "pw" in windows:
            pair_encs[spec] = SentenceTransformerEncoder("minilm", device="cpu", runtime=rt, long_text=lt,
                                                         max_tokens=windows["pw"])
        if "sw" in windows:
            session_encs[spec] = SentenceTransformerEncoder("minilm", device="cpu", runtime=rt, long_text=lt,
                                                            max_tokens=windows["sw"])
    torch_enc = encs.get("torch:truncate") or SentenceTransformerEncoder("minilm", device="cpu", runtime="torch")
    gen_out, gen_cost = {}, {}
    for g in args.gens.split(","):
        gen_out[g], gen_cost[g] = generate(records, g, torch_enc)
        print(f"generated {g}: {gen_cost[g] * 1000:.1f} ms/session", flush=True)
    rows = []
    for spec, enc in encs.items():
        for g in gen_out:
            t0 = time.perf_counter()
            res = evaluate(records, gen_out[g], enc, cache, methods, pair_enc=pair_encs.get(spec),
                           session_enc=session_encs.get(spec))
            rows.append((g, spec, res))
            print(f"evaluated {g} x {spec} in {time.perf_counter() - t0:.0f}s: "
                  + ", ".join(f"{m} {v[5]:.1f}" for m, v in res.items()), flush=True)
    # runtime agreement: max cosine difference vs torch fp32 on every text both encoded
    if "torch:truncate" in encs:
        ref = cache.mem.get(encs["torch:truncate"].name, {})
        for spec, enc in encs.items():
            d = cache.mem.get(enc.name, {})
            common = sorted(set(ref) & set(d))
            if common and spec != "torch:truncate":
                a = np.stack([ref[k] for k in common])
                b = np.stack([d[k] for k in common])
                cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                print(f"{spec}: max cosine difference vs torch fp32 over {len(common)} texts: {1 - cos.min():.2e} "
                      f"(mean {1 - cos.mean():.2e})")
    print("\n| generator | encoder | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for g, spec, res in rows:
        print(f"| {g} | {spec} | " + " | ".join("/".join(f"{res[m][k]:.1f}" for k in (3, 5, 10)) for m in methods)
              + " |")
    print(f"\ncells: R_all@3/5/10 (%), {args.format} session level, {Path(args.data).name}; generation ms/session: "
          + ", ".join(f"{g} {c * 1000:.1f}" for g, c in gen_cost.items()))


if __name__ == "__main__":
    main()

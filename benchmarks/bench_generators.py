"""Compare summary/keyword generators on LoCoMo sessions: SmolLM2 with the paper's prompts (paper-v1) and
with the small-model prompts (small-v1), against the LLM-free generator (tf-idf keyphrases + tf-idf/MMR
sentences, the default; and the previous YAKE + encoder-centroid sentences). ``--skip-llm`` runs only the
LLM-free ones (seconds instead of minutes).

Measures per generator: share of usable summaries and keyword lists (after memgas' cleaning/validation),
mean summary length (words), mean keyword count, seconds per session, and a quality proxy: the cosine
(MiniLM) between the summary and LoCoMo's own GPT ``session_summary``.

    .venv/bin/python benchmarks/bench_generators.py [--n 12] [--data /work/shared/data/locomo/locomo10.json]

Each session is rendered "Speaker: text" lines. Sessions are taken round-robin over the conversations so
the sample is not one pair of speakers.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from pathlib import Path

import numpy as np

from memgas.pipeline.config import GenerationConfig
from memgas.pipeline.generate import generate_for_sessions
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.llm_free import LLMFreeGenerator
from memgas.pipeline.models.encoders import SentenceTransformerEncoder
from memgas.pipeline.models.llms import TransformersLLM


def load_sessions(path: str, n: int) -> list[tuple[str, str]]:
    data = json.loads(Path(path).read_text())
    per_conv: list[list[tuple[str, str]]] = []
    for conv in data:
        c = conv["conversation"]
        keys = sorted((k for k in c if re.fullmatch(r"session_\d+", k) and c[k]), key=lambda k: int(k.split("_")[1]))
        items = []
        for k in keys:
            text = "\n".join(f"{u['speaker']}: {u['text']}" for u in c[k])
            summ = conv.get("session_summary", {}).get(f"{k}_summary")
            if summ:
                items.append((text, summ))
        per_conv.append(items)
    out: list[tuple[str, str]] = []
    i = 0
    while len(out) < n and any(i < len(x) for x in per_conv):
        for x in per_conv:
            if i < len(x) and len(out) < n:
                out.append(x[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="/work/shared/data/locomo/locomo10.json")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--summary-max-tokens", type=int, default=120)
    ap.add_argument("--keywords-max-tokens", type=int, default=48)
    ap.add_argument("--max-input-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-llm", action="store_true", help="only the LLM-free generators")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    sessions = load_sessions(args.data, args.n)
    enc = SentenceTransformerEncoder("minilm", device="cpu", runtime="torch")
    t0 = time.perf_counter()
    llm = None if args.skip_llm else TransformersLLM("smollm2", context_tokens=4096, dtype=args.dtype)
    print(f"# {len(sessions)} LoCoMo sessions; SmolLM2 load {time.perf_counter() - t0:.1f}s")
    gold = enc.encode([s for _, s in sessions])
    items = [(text_hash(t), t, "locomo") for t, _ in sessions]

    new_free = LLMFreeGenerator(None)
    new_free.keywords(["warm up: load the background word list"])
    old_free = LLMFreeGenerator(enc, keyword_method="yake", summary_method="centroid")
    runs = [
        ("llm-free (tf-idf keyphrases + tf-idf/MMR summary)", GenerationConfig(generator="llm-free"), new_free),
        ("llm-free (yake + encoder centroid, previous)", GenerationConfig(generator="llm-free"), old_free),
    ]
    if llm is not None:
        runs += [
            ("smollm2 paper-v1", GenerationConfig(generator="llm", prompt_version="paper-v1"), None),
            ("smollm2 small-v1", GenerationConfig(generator="llm", prompt_version="small-v1"), None),
        ]
    rows = []
    for name, cfg, free in runs:
        cfg = cfg.model_copy(
            update=dict(
                summary_max_tokens=args.summary_max_tokens,
                keywords_max_tokens=args.keywords_max_tokens,
                max_input_tokens=args.max_input_tokens,
            )
        )
        t = time.perf_counter()
        table = generate_for_sessions(items, llm, cfg, key=(name, "bench"), llm_free=free)
        dt = time.perf_counter() - t
        d = table.to_pylist()
        summ = [r for r in d if r["kind"] == "summary"]
        kws = [r for r in d if r["kind"] == "keywords"]
        ok_s = [r["error"] is None and bool(r["output"]) for r in summ]
        ok_k = [r["error"] is None and bool(r["output"]) for r in kws]
        vec = enc.encode([r["output"] or "" for r in summ])
        cos = np.sum(vec * gold, axis=1) / (np.linalg.norm(vec, axis=1) * np.linalg.norm(gold, axis=1) + 1e-12)
        cos_ok = float(np.mean(cos[np.array(ok_s)])) if any(ok_s) else float("nan")
        rows.append(
            (
                name,
                np.mean(ok_s),
                np.mean(ok_k),
                np.mean([len(r["output"].split()) for r, o in zip(summ, ok_s) if o]) if any(ok_s) else 0.0,
                np.mean([len(r["output"].split("; ")) for r, o in zip(kws, ok_k) if o]) if any(ok_k) else 0.0,
                dt / len(items),
                float(np.mean(np.where(ok_s, cos, 0.0))),
                cos_ok,
            )
        )
        ex_s = next((r["output"] for r, o in zip(summ, ok_s) if o), "")
        ex_k = next((r["output"] for r, o in zip(kws, ok_k) if o), "")
        bad = [r["error"] for r in summ + kws if r["error"]]
        print(f"\n## {name}\n  summary example: {ex_s[:200]!r}\n  keywords example: {ex_k[:160]!r}")
        if bad:
            reasons: dict[str, int] = {}
            for b in bad:
                reasons[b] = reasons.get(b, 0) + 1
            print("  unusable:", dict(sorted(reasons.items(), key=lambda x: -x[1])))

    print(
        "\n| generator | usable summaries | usable keyword lists | summary words | keywords/list "
        "| s/session | cos to GPT summary (unusable=0) | cos (usable only) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.0%} | {r[2]:.0%} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.3f} | {r[7]:.3f} |")


if __name__ == "__main__":
    main()

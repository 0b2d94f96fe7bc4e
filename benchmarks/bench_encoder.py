"""Encoder throughput on CPU: our length-bucketed path vs ``SentenceTransformer.encode`` defaults.

Texts: LoCoMo turn pairs and whole sessions (the two text shapes memgas embeds most), or synthetic mixed
lengths when the data file is missing. Prints texts/s, tokens/s, the speed ratio and the max abs diff of
the embeddings (both paths see the same truncated inputs, so they must agree to float noise).

    .venv/bin/python benchmarks/bench_encoder.py [--locomo PATH] [--limit N] [--batch-size 64]
    .venv/bin/python benchmarks/bench_encoder.py --runtimes torch,onnx,onnx-int8 [--repeats 3]

``--runtimes``: the same texts through each ``encoder.runtime``, interleaved (torch, onnx, int8, torch, ...)
``--repeats`` times so machine load hits all alike; reports the best and median tokens/s per runtime, the
ratio to torch fp32, and the max cosine difference of the vectors against torch fp32.

``--batching``: the cost of batch-invariant vectors. memgas's encoder (unpadded equal-length batches, one
intra-op thread per batch; ``W`` worker threads running batches side by side) against the engine it replaced
(length-sorted batches padded to their longest text under the same token budget, computing with the
process's torch threads), each at 1 thread and at every core (``--threads``, default all), interleaved
``--repeats`` times on the same texts, model and calls (``--unit`` texts per ``encode`` call, as the encode
stage's units; 0: one call). On the same inputs it checks that memgas's vectors equal each text encoded
alone and the 1-worker vectors, bit for bit, and counts how many of the padded engine's do not.
``--longmemeval PATH``: LongMemEval turn pairs and sessions instead of LoCoMo's.

    .venv/bin/python benchmarks/bench_encoder.py --batching [--limit 1000] [--repeats 3] [--unit 512]
        [--longmemeval ../shared/data/longmemeval/longmemeval_s_sample.json] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np

from memgas.pipeline.models.encoders import SentenceTransformerEncoder


def locomo_texts(path: Path, limit: int) -> list[str]:
    data = json.loads(path.read_text())
    turns: list[str] = []
    sessions: list[str] = []
    for conv in data:
        c = conv["conversation"]
        for k in sorted(c, key=str):
            if not k.startswith("session_") or k.endswith("date_time") or not isinstance(c[k], list):
                continue
            utt = [f"{u['speaker']}: {u['text']}" for u in c[k]]
            sessions.append("\n".join(utt))
            turns.extend("\n".join(utt[i : i + 2]) for i in range(0, len(utt), 2))
    rng = random.Random(0)
    rng.shuffle(turns)
    n_sess = min(len(sessions), max(1, limit // 10))
    return turns[: limit - n_sess] + sessions[:n_sess]


def synthetic(limit: int) -> list[str]:
    rng = random.Random(0)
    words = "memory session user assistant talked about trip dog museum dinner job robotics city".split()
    return [" ".join(rng.choice(words) for _ in range(rng.choice([5, 20, 60, 200, 600]))) for _ in range(limit)]


def compare_runtimes(texts: list[str], runtimes: list[str], batch_size: int, repeats: int) -> None:
    encs = {rt: SentenceTransformerEncoder("minilm", device="cpu", batch_size=batch_size, runtime=rt) for rt in runtimes}
    for e in encs.values():
        e.encode(texts[:16])  # warm-up
    times: dict[str, list[float]] = {rt: [] for rt in runtimes}
    vecs: dict[str, np.ndarray] = {}
    tokens = 0
    for _ in range(repeats):
        for rt, e in encs.items():
            t0 = time.perf_counter()
            vecs[rt] = e.encode(texts)
            times[rt].append(time.perf_counter() - t0)
            tokens = e.last_stats.tokens
    ref = vecs.get("torch")
    base = min(times["torch"]) if "torch" in times else None
    print(f"{len(texts)} texts, {tokens:,} tokens encoded per pass, {repeats} interleaved passes")
    print("| runtime | best s | tokens/s (best) | tokens/s (median) | vs torch fp32 | max cosine diff vs torch |")
    print("|---|---|---|---|---|---|")
    for rt in runtimes:
        best, med = min(times[rt]), float(np.median(times[rt]))
        cos = "" if ref is None else f"{1 - ((vecs[rt] * ref).sum(1) / np.linalg.norm(vecs[rt], axis=1) / np.linalg.norm(ref, axis=1)).min():.2e}"
        ratio = "" if base is None else f"{base / best:.2f}x"
        print(f"| {encs[rt].name} | {best:.2f} | {tokens / best:,.0f} | {tokens / med:,.0f} | {ratio} | {cos} |")


def padded_baseline(enc: SentenceTransformerEncoder, texts: list[str]) -> np.ndarray:
    """The engine before batch-invariant vectors: truncate, sort by length, pad each batch to its longest
    piece under a budget of ``batch_size`` full-length rows (at most 8x rows for short pieces); identical
    pieces run once, as they did then."""
    import torch

    prefix, suffix = enc._special_wrap()
    window = enc.max_tokens - len(prefix) - len(suffix)
    pieces = [prefix + list(x[:window]) + suffix for x in enc._tokenize(texts)]
    first: dict[tuple[int, ...], int] = {}
    source = [first.setdefault(tuple(q), k) for k, q in enumerate(pieces)]
    order = sorted(set(source), key=lambda i: len(pieces[i]))
    out = np.zeros((len(pieces), enc.dim), np.float32)
    budget, max_rows, start = enc.batch_size * enc.max_tokens, enc.batch_size * 8, 0
    pad = enc._tokenizer.pad_token_id or 0
    with torch.inference_mode():
        while start < len(order):
            end = start + 1
            while end < len(order) and end - start < max_rows and (end + 1 - start) * len(pieces[order[end]]) <= budget:
                end += 1
            idx = order[start:end]
            width = len(pieces[idx[-1]])
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, j in enumerate(idx):
                ids[r, : len(pieces[j])] = torch.tensor(pieces[j])
                mask[r, : len(pieces[j])] = 1
            out[idx] = enc._forward(ids, mask).float().numpy()
            start = end
    return out[source]


def longmemeval_texts(path: Path, limit: int) -> list[str]:
    """Unique LongMemEval turn pairs and sessions as memgas's loader writes them, in the sample's order:
    each session next to its pairs (as the encode stage plans them), cut at ``limit`` texts."""
    from memgas.pipeline.data.common import Warnings
    from memgas.pipeline.data.longmemeval import load

    out: dict[str, str] = {}
    for r in load(path, Warnings(str(path))):
        pairs: dict[str, list[str]] = {}
        for q in r.pairs:
            pairs.setdefault(q["session_hash"], []).append(r.texts[q["text_hash"]])
        for s in r.sessions:
            for t in (r.texts[s["text_hash"]], *pairs.get(s["text_hash"], [])):
                out.setdefault(t, t)
                if len(out) >= limit:
                    return list(out)
    return list(out)


def compare_batching(texts: list[str], batch_size: int, repeats: int, unit: int, threads: int,
                     max_tokens: int | None) -> None:
    import torch

    enc = SentenceTransformerEncoder("minilm", device="cpu", batch_size=batch_size).with_max_tokens(max_tokens)
    calls = [texts[a : a + unit] for a in range(0, len(texts), unit)] if unit > 0 else [texts]
    before = torch.get_num_threads()

    def ours(workers: int) -> np.ndarray:
        enc.workers = workers
        return np.concatenate([enc.encode(c) for c in calls])

    def padded(n_threads: int) -> np.ndarray:
        torch.set_num_threads(n_threads)  # the replaced engine computed with the process's torch threads
        try:
            return np.concatenate([padded_baseline(enc, c) for c in calls])
        finally:
            torch.set_num_threads(before)

    engines = {f"padded (previous), {threads} threads": lambda: padded(threads),
               f"memgas, {threads} workers": lambda: ours(threads),
               "padded (previous), 1 thread": lambda: padded(1),
               "memgas, 1 worker": lambda: ours(1)}
    if threads == 1:
        engines = {k: v for k, v in engines.items() if "1 " in k}
    ours(1)
    padded(1)  # warm-up (every call's shapes once)
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    vecs: dict[str, np.ndarray] = {}
    load0 = os.getloadavg()
    for _ in range(repeats):
        for name, fn in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            vecs[name] = fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    enc.workers = 1
    tokens = 0
    for c in calls:
        enc.encode(c)
        tokens += enc.last_stats.tokens
    sample = list(range(0, len(texts), max(1, len(texts) // 100)))
    alone = np.stack([enc.encode([texts[i]])[0] for i in sample])
    one = vecs["memgas, 1 worker"]
    print(f"{len(texts)} texts in {len(calls)} calls, window {enc.max_tokens}, {tokens:,} tokens per pass (unpadded), {repeats} interleaved passes; load average "
          f"{load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    print("| engine | best s | median s | CPU s (median) | tokens/s (best) | speed vs padded at the same threads "
          "(best; median) | rows equal to the text alone | rows equal to memgas at 1 worker |")
    print("|---|---|---|---|---|---|---|---|")
    for name in engines:
        best, med = min(wall[name]), float(np.median(wall[name]))
        n = name.split(", ")[1].split()[0]
        ref = next(k for k in engines if k.startswith("padded") and k.endswith((f"{n} thread", f"{n} threads")))
        ratio = f"{min(wall[ref]) / best:.2f}x; {float(np.median(wall[ref])) / med:.2f}x"
        same = int((vecs[name][sample] == alone).all(axis=1).sum())
        eq1 = int((vecs[name] == one).all(axis=1).sum())
        print(f"| {name} | {best:.2f} | {med:.2f} | {float(np.median(cpu[name])):.2f} | {tokens / best:,.0f} | "
              f"{ratio} | {same}/{len(sample)} | {eq1}/{len(texts)} |")
    if threads > 1:
        a, b = f"memgas, {threads} workers", "padded (previous), 1 thread"
        print(f"memgas at {threads} workers vs the padded engine at 1 thread: {min(wall[b]) / min(wall[a]):.2f}x (best)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--locomo", default="/work/shared/data/locomo/locomo10.json")
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--runtimes", default=None, help="e.g. torch,onnx,onnx-int8: compare runtimes instead")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batching", action="store_true", help="the cost of batch-invariant vectors (see above)")
    ap.add_argument("--longmemeval", default=None, help="--batching: LongMemEval pairs and sessions from this file")
    ap.add_argument("--unit", type=int, default=512, help="--batching: texts per encode call (0: one call)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="--batching: threads / workers")
    ap.add_argument("--max-tokens", type=int, default=None, help="--batching: the encoder's window (default the model's)")
    a = ap.parse_args(argv)
    p = Path(a.locomo)
    if a.longmemeval:
        texts = longmemeval_texts(Path(a.longmemeval), a.limit)
    else:
        texts = locomo_texts(p, a.limit) if p.is_file() else synthetic(a.limit)
    if a.runtimes:
        compare_runtimes(texts, a.runtimes.split(","), a.batch_size, a.repeats)
        return
    if a.batching:
        compare_batching(texts, a.batch_size, a.repeats, a.unit, a.threads, a.max_tokens)
        return
    enc = SentenceTransformerEncoder("minilm", device="cpu", batch_size=a.batch_size, runtime="torch")
    st = enc.sentence_transformer
    n_tok = int(np.minimum(enc.count_tokens(texts) + 2, enc.max_tokens).sum())
    print(f"texts: {len(texts)} ({'LoCoMo turn pairs + sessions' if p.is_file() else 'synthetic'}), "
          f"tokens after truncation: {n_tok}, max_tokens={enc.max_tokens}")
    enc.encode(texts[:16])
    st.encode(texts[:16])  # warm-up both

    t0 = time.perf_counter()
    ours = enc.encode(texts)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = st.encode(texts, convert_to_numpy=True)  # defaults: batch_size=32, its own length sort
    t_ref = time.perf_counter() - t0
    print(f"memgas bucketed (batch {a.batch_size}): {t_ours:6.2f}s  {len(texts)/t_ours:7.1f} texts/s  "
          f"{n_tok/t_ours:8.0f} tok/s  truncated={enc.last_stats.n_truncated} batches={enc.last_stats.n_batches}")
    print(f"SentenceTransformer.encode defaults: {t_ref:6.2f}s  {len(texts)/t_ref:7.1f} texts/s  "
          f"{n_tok/t_ref:8.0f} tok/s")
    print(f"speed ratio (ours / ST): {t_ref / t_ours:.2f}x   max |diff| of embeddings: {np.abs(ours-ref).max():.2e}")


if __name__ == "__main__":
    main()

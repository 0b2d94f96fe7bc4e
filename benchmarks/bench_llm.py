"""Prompt and completion tokens/s of the CPU default LLM (SmolLM2-135M GGUF via transformers) on 8
summary-like prompts: one padded batch of 8 vs one prompt at a time, for float32 and bfloat16.

    .venv/bin/python benchmarks/bench_llm.py [--max-tokens 48] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from memgas.pipeline.models.base import SamplingParams
from memgas.pipeline.models.llms import TransformersLLM

INSTR = ("Below is an user-user dialogue memory. Please summarize the following dialogue as concisely as "
         "possible in a short paragraph, extracting the main themes and key information.")


def prompts(n: int = 8) -> list[list[dict[str, str]]]:
    p = Path("/work/shared/data/locomo/locomo10.json")
    out = []
    if p.is_file():
        c = json.loads(p.read_text())[0]["conversation"]
        for k in range(1, n + 1):
            utt = c.get(f"session_{k}") or []
            # a prefix of each session keeps the run short while lengths still vary between prompts
            text = "\n".join(f"{u['speaker']}: {u['text']}" for u in utt[: 4 + 2 * k])
            out.append([{"role": "user", "content": f"{text}\n\n{INSTR}\n\nYour answer:"}])
    while len(out) < n:
        out.append([{"role": "user", "content": "A: I went hiking.\nB: Nice, where?\n" * (len(out) + 1)
                     + f"\n{INSTR}\n\nYour answer:"}])
    return out


def run(llm: TransformersLLM, ps: list, params: SamplingParams, batched: bool) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    res = llm.generate(ps, params) if batched else [llm.generate([p], params)[0] for p in ps]
    dt = time.perf_counter() - t0
    assert all(r.ok for r in res), [r.error for r in res]
    return dt, sum(r.prompt_tokens for r in res), sum(r.completion_tokens for r in res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    ps = prompts()
    params = SamplingParams(max_tokens=a.max_tokens)
    for dtype in a.dtypes.split(","):
        t0 = time.perf_counter()
        llm = TransformersLLM(dtype=dtype, batch_size=8)
        print(f"[{dtype}] load {time.perf_counter() - t0:.1f}s")
        llm.generate(ps[:1], SamplingParams(max_tokens=2))  # warm-up
        for batched in (True, False):
            dt, pt, ct = run(llm, ps, params, batched)
            mode = "batch of 8" if batched else "one at a time"
            print(f"[{dtype}] {mode:14s}: {dt:6.1f}s  prompt {pt} tok ({pt/dt:6.1f} tok/s)  "
                  f"completion {ct} tok ({ct/dt:5.1f} tok/s)")


if __name__ == "__main__":
    main()

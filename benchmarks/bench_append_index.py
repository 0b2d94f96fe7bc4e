"""Index after an append through the real job: O(new) work, and the same edges as one build.

One synthetic text history (``memgas synth``: one question, ``--sessions`` sessions of ``--turns``
utterances) is cut in two: A = all but the last ``--append`` sessions, B = those. Measured in one run, the
real index stages (LLM-free generate, nodes, MiniLM encode, associate) on CPU without Ray:

1. ``grown``: ingest A, index (timed), ``ingest B --append``, index again (timed: the work after an append);
2. ``fresh`` (the baseline): ingest A, append B, one index over everything (timed).

Printed: per-stage seconds of the index after the append and of the fresh index, their ratio, rows
associated by each, and the correctness check on the same inputs: the two banks' edges are equal, row for
row (similarities compared exactly). Exit 1 if they differ.

    python benchmarks/bench_append_index.py [--sessions 300] [--append 30] [--turns 6]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def to_jsonl(lme: Path, out_a: Path, out_b: Path, n_append: int) -> tuple[int, int]:
    """The synthetic LongMemEval question as one JSONL history, split into its first and last sessions."""
    q = json.loads(lme.read_text())[0]
    sessions = [{"session_id": sid, "date": date, "turns": [{"role": t["role"], "content": t["content"]} for t in turns]}
                for sid, date, turns in zip(q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"])]
    question = {"query_id": q["question_id"], "question": q["question"], "answer": str(q["answer"]),
                "question_date": q["question_date"], "question_type": q["question_type"],
                "evidence_session_ids": q["answer_session_ids"]}
    cut = len(sessions) - n_append
    for path, part, qs in ((out_a, sessions[:cut], []), (out_b, sessions[cut:], [question])):
        path.write_text(json.dumps({"history_id": "h0", "speakers": ["user", "assistant"], "sessions": part,
                                    "questions": qs}) + "\n")
    return cut, len(sessions)


def index(cfg, bank: Path) -> dict[str, float]:
    from memgas.jobs import main_job
    from memgas.jobs.profiling import Profiler

    prof = Profiler()
    t0 = time.perf_counter()
    main_job.index(cfg, bank, prof=prof, use_ray=False)
    out = {name: st.wall_s for name, st in prof.stages.items()}
    out["total"] = time.perf_counter() - t0
    return out


def edges(bank: Path) -> list[tuple]:
    from memgas.pipeline.bank import Bank

    t = Bank(bank).read("edges")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "mode", "src", "dst", "similarity"))))


def segments(bank: Path) -> list[tuple]:
    from memgas.pipeline.bank import Bank

    t = Bank(bank).read("edge_segments")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "first_session", "end_session"))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--append", type=int, default=30)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    from memgas.pipeline.append import append
    from memgas.pipeline.config import MemgasConfig
    from memgas.pipeline.data.synth import synth
    from memgas.pipeline.ingest import ingest

    with tempfile.TemporaryDirectory(prefix="bench_append_") as tmp:
        d = Path(tmp)
        cfg = MemgasConfig.load(REPO / "configs" / "demo.yaml",
                                ["reading.enabled=false", f"data.path={d / 'a.jsonl'}", "data.format=jsonl",
                                 # MemGAS's methods only: the index stages named above, not JustMem's cards
                                 "retrieval.methods=[session,turn,summary,keyword,hybrid,memgas]"])
        synth(d / "lme.json", questions=1, sessions_per_history=args.sessions, turns_per_session=args.turns,
              reuse_share=0.0)
        n_a, n_all = to_jsonl(d / "lme.json", d / "a.jsonl", d / "b.jsonl", args.append)
        grown, fresh = d / "grown", d / "fresh"
        ingest(d / "a.jsonl", "jsonl", grown, progress=False)
        t_a = index(cfg, grown)
        append(d / "b.jsonl", "jsonl", grown, progress=False)
        t_grow = index(cfg, grown)
        ingest(d / "a.jsonl", "jsonl", fresh, progress=False)
        append(d / "b.jsonl", "jsonl", fresh, progress=False)
        t_fresh = index(cfg, fresh)
        same = edges(grown) == edges(fresh)
        seg_grown, seg_fresh = segments(grown), segments(fresh)
        n_edges = len(edges(fresh))

    stages = [s for s in ("generate", "nodes", "encode", "associate", "total") if s in t_fresh]
    print(f"one history: {n_a} sessions indexed, then {n_all - n_a} appended ({args.turns} utterances each); "
          f"CPU, no Ray, LLM-free generator, MiniLM")
    print(f"{'stage':<10} {'index A':>9} {'after append':>13} {'fresh A+B':>10} {'fresh / after':>14}")
    for s in stages:
        ratio = t_fresh[s] / t_grow[s] if t_grow.get(s) else float("nan")
        print(f"{s:<10} {t_a.get(s, 0):>8.2f}s {t_grow.get(s, 0):>12.2f}s {t_fresh[s]:>9.2f}s {ratio:>13.1f}x")
    print(f"segments after append: {seg_grown}; fresh: {seg_fresh}")
    print(f"edges equal (grown vs fresh, exact): {same} ({n_edges:,} edges)")
    if args.json:
        args.json.write_text(json.dumps({"sessions": n_all, "appended": n_all - n_a, "index_a": t_a,
                                         "after_append": t_grow, "fresh": t_fresh, "edges_equal": same,
                                         "edges": n_edges}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Answer after an append through the real job: only the changed histories are ranked.

``memgas synth`` histories (``--histories`` questions, one history each, ``--sessions`` sessions of
``--turns`` utterances) as user JSONL: A = every history, all but the last ``--append`` sessions of the
first one; B = those sessions and the first history's question. CPU, no Ray, the demo's models (LLM-free generator, MiniLM), reading off.
Measured in one run:

1. ingest A, index, ``memgas answer`` into a run directory (every question ranked);
2. ``ingest B --append``, index, ``memgas answer`` into the same run directory (timed: only the first
   history's questions are ranked, the others' rankings kept);
3. ``memgas answer`` of the same bank into a new run directory (timed: every question ranked, which is
   what ``answer`` did after an append before rankings were kept per history).

Printed: the rank stage's and the whole command's seconds of 2 and 3, what each ranked and kept (from
run_record.json), and the check that their rankings rows and retrieval metrics are equal. Exit 1 if not.

    python benchmarks/bench_answer_append.py [--histories 60] [--sessions 20] [--append 2] [--turns 4]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def to_jsonl(lme: Path, out_a: Path, out_b: Path, n_append: int) -> None:
    """Each synthetic LongMemEval question as one JSONL history; the first history's last sessions in B."""
    a, b = [], []
    for i, q in enumerate(json.loads(lme.read_text())):
        sessions = [{"session_id": f"h{i}-{sid}", "date": date,
                     "turns": [{"role": t["role"], "content": t["content"]} for t in turns]}
                    for sid, date, turns in zip(q["haystack_session_ids"], q["haystack_dates"], q["haystack_sessions"])]
        question = {"query_id": q["question_id"], "question": q["question"], "answer": str(q["answer"]),
                    "question_date": q["question_date"], "question_type": q["question_type"],
                    "evidence_session_ids": [f"h{i}-{s}" for s in q["answer_session_ids"]]}
        cut = len(sessions) - (n_append if i == 0 else 0)
        # the first history's question comes with B (its evidence may be among B's sessions)
        a.append({"history_id": f"h{i:04d}", "speakers": ["user", "assistant"], "sessions": sessions[:cut],
                  "questions": [question] if i else []})
        if i == 0:
            b.append({"history_id": f"h{i:04d}", "speakers": ["user", "assistant"], "sessions": sessions[cut:],
                      "questions": [question]})
    out_a.write_text("".join(json.dumps(r) + "\n" for r in a))
    out_b.write_text("".join(json.dumps(r) + "\n" for r in b))


def answer(cfg, bank: Path, run: Path) -> tuple[float, float, dict]:
    """(rank stage seconds, command seconds, the rank stage's run_record entry)."""
    from memgas.jobs import main_job

    t0 = time.perf_counter()
    main_job.answer(cfg, bank, run_dir=run, use_ray=False)
    total = time.perf_counter() - t0
    metrics = json.loads((run / "metrics.json").read_text())
    entry = next(e for e in metrics["record"] if e["stage"] == "rank")
    return metrics["stages"]["rank"]["wall_s"], total, entry


def rankings(run: Path) -> tuple[list, dict]:
    from memgas.pipeline.bank import Bank

    rows = Bank(run / "results").read("rankings").to_pylist()
    rows.sort(key=lambda r: (r["method"], r["query_id"], r["rank"]))
    return rows, json.loads((run / "metrics.json").read_text())["retrieval"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--histories", type=int, default=60)
    ap.add_argument("--sessions", type=int, default=20)
    ap.add_argument("--append", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    from memgas.jobs import main_job
    from memgas.pipeline.append import append
    from memgas.pipeline.config import MemgasConfig
    from memgas.pipeline.data.synth import synth
    from memgas.pipeline.ingest import ingest

    with tempfile.TemporaryDirectory(prefix="bench_answer_") as tmp:
        d = Path(tmp)
        cfg = MemgasConfig.load(REPO / "configs" / "demo.yaml",
                                ["reading.enabled=false", f"data.path={d / 'a.jsonl'}", "data.format=jsonl",
                                 "retrieval.methods=[session,memgas,memgas-no-gmm]"])
        synth(d / "lme.json", questions=args.histories, sessions_per_history=args.sessions,
              turns_per_session=args.turns, reuse_share=0.8)
        to_jsonl(d / "lme.json", d / "a.jsonl", d / "b.jsonl", args.append)
        bank, run, fresh = d / "bank", d / "run", d / "fresh"
        ingest(d / "a.jsonl", "jsonl", bank, progress=False)
        main_job.index(cfg, bank, use_ray=False)
        first = answer(cfg, bank, run)
        append(d / "b.jsonl", "jsonl", bank, progress=False)
        main_job.index(cfg, bank, use_ray=False)
        grown = answer(cfg, bank, run)
        full = answer(cfg, bank, fresh)
        same = rankings(run) == rankings(fresh)

    print(f"{args.histories} histories of {args.sessions} sessions ({args.turns} utterances, one question each); "
          f"{args.append} sessions appended to one; CPU, no Ray, LLM-free generator, MiniLM, reading off")
    print(f"{'answer':<34} {'rank s':>8} {'command s':>10}  ranked / kept (histories, questions)")
    for name, (rank_s, total, e) in (("first (all ranked)", first), ("after the append, same run dir", grown),
                                     ("after the append, new run dir", full)):
        print(f"{name:<34} {rank_s:>8.2f} {total:>10.2f}  {e.get('histories_ranked')}/{e.get('histories_kept')} "
              f"histories, {e.get('questions_ranked')}/{e.get('questions_kept')} questions")
    print(f"rank: new run dir / same run dir = {full[0] / grown[0]:.1f}x; command: {full[1] / grown[1]:.1f}x")
    print(f"rankings and retrieval metrics equal (same run dir vs new): {same}")
    if args.json:
        args.json.write_text(json.dumps({"first": first, "after_append": grown, "new_run_dir": full,
                                         "equal": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

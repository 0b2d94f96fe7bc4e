"""The index driver's own work at full LongMemEval-S scale, which the 22-question sample cannot show.

``bench_index_cpu.py`` extrapolates the sample's per-stage times linearly. Costs that grow with units x bank
size (the driver reading each unit's inputs from the bank) do not scale linearly, so this benchmark builds a
bank of the full split's size and times what the driver does for the generate and encode stages, without
running the models: planning, and reading every unit's inputs, with the block reads the stages use
(``TextBlocks``) against one filtered read per unit (the previous code; timed on ``--per-unit-sample`` units
and extrapolated, since all of them would take many minutes).

The bank: the S sample copied ``--copies`` times (17 x 1,076 = 18,292 unique sessions, the full split has
18,750), each copy's turns marked so that every text is new. Generation runs in-process (LLM-free, one core,
a few minutes) because encode's inputs are the generated texts.

    python benchmarks/bench_driver_scale.py [--copies 17] [--per-unit-sample 12] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "longmemeval" / "longmemeval_s_sample.json"


def make_copies(src: Path, out: Path, copies: int) -> None:
    """``copies`` marked copies of every question of a LongMemEval file (new ids, new session texts)."""
    data = json.loads(src.read_text())
    rows = []
    for k in range(copies):
        for q in data:
            c = dict(q)
            c["question_id"] = f"{q['question_id']}~{k}"
            c["haystack_session_ids"] = [f"{s}~{k}" for s in q["haystack_session_ids"]]
            c["answer_session_ids"] = [f"{s}~{k}" for s in q.get("answer_session_ids", [])]
            c["haystack_sessions"] = [[{**t, "content": f"{t['content']} [{k}]"} for t in sess]
                                      for sess in q["haystack_sessions"]]
            rows.append(c)
    out.write_text(json.dumps(rows))


def stage_ctx(cfg, bank):
    from memgas.jobs import runner
    from memgas.jobs.stage import StageContext
    from memgas.jobs.placement import resolve_stage_runtimes

    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    return ctx


def time_inputs(stage, ctx, units: list[dict], per_unit_sample: int) -> dict[str, float]:
    """Seconds to plan-read every unit's inputs through the stage (block reads), and the extrapolated
    seconds of one filtered read per unit."""
    from memgas.jobs.stages.texts import texts_by_hash

    t0 = time.perf_counter()
    ctx.units, ctx.scratch = units, {}  # what the executor sets before a stage's first inputs
    for u in units:
        stage.inputs(ctx, u)
    blocked = time.perf_counter() - t0
    reads = ctx.scratch["texts"].reads
    step = max(1, len(units) // per_unit_sample)
    sample = units[::step][:per_unit_sample]
    hashes_of = (lambda u: u["hashes"]) if stage.name == "encode" else (lambda u: [it[0] for it in u["items"]])
    t0 = time.perf_counter()
    for u in sample:
        texts_by_hash(ctx.bank, hashes_of(u))
    per_unit = (time.perf_counter() - t0) / max(len(sample), 1)
    return {"units": len(units), "blocked_s": blocked, "reads": reads, "per_unit_read_s": per_unit,
            "per_unit_total_s": per_unit * len(units)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--copies", type=int, default=17)
    ap.add_argument("--per-unit-sample", type=int, default=12, help="units timed with one read each")
    ap.add_argument("--keep", default=None, help="build the bank in this folder and keep it (reused if there)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")

    from memgas.jobs import main_job, runner, tables
    from memgas.jobs.profiling import Profiler
    from memgas.jobs.units import chunk
    from memgas.pipeline.config import MemgasConfig

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-driver-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"lme_s_x{args.copies}.json"
    if not data.exists():
        t0 = time.perf_counter()
        make_copies(Path(args.data), data, args.copies)
        print(f"wrote {data} ({data.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - t0:.0f}s", flush=True)
    cfg = MemgasConfig.load(ROOT / "configs" / "longmemeval_s.yaml", [f"output_dir={work / 'run'}", f"data.path={data}"])
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    bank, _ = main_job.ensure_ingested(cfg, Profiler())
    timings["ingest"] = time.perf_counter() - t0
    ctx = stage_ctx(cfg, bank)
    for name in ("generate", "nodes"):
        t0 = time.perf_counter()
        stage = next(s for s in ctx.pipeline if s.name == name)
        runner.run_stage(stage, ctx, stage.active(ctx), tables.store_of(ctx, stage), ctx.fingerprints[name],
                         Profiler(), {})
        timings[name] = time.perf_counter() - t0
        print(f"{name}: {timings[name]:.0f}s", flush=True)
    n_sessions = len(set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist()))
    n_texts = bank.read("texts", ["text_hash"]).num_rows

    rows = []
    for name in ("generate", "encode"):
        ctx = stage_ctx(cfg, bank)
        stage = next(s for s in ctx.pipeline if s.name == name)
        if name == "generate":  # generation is done: plan it as if it were not (the same units a fresh run has)
            units = [{"part": f"gen-{i:05d}", "size": len(b), "kind": "user-ai",
                      "items": [[h, None, ["summary", "keywords"]] for h in b]}
                     for i, b in enumerate(chunk(sorted(set(bank.read("sessions", ["text_hash"])["text_hash"].to_pylist())),
                                                   cfg.ray.generate_unit))]
            plan_s = float("nan")
        else:
            t0 = time.perf_counter()
            units = stage.plan(ctx)
            plan_s = time.perf_counter() - t0
        r = time_inputs(stage, ctx, units, args.per_unit_sample)
        rows.append((name, plan_s, r))
    print(f"\nbank: {n_sessions:,} unique sessions, {n_texts:,} texts ({args.copies} marked copies of "
          f"{Path(args.data).name}); ingest {timings['ingest']:.0f}s, generate {timings['generate']:.0f}s (in-process, one core)")
    print("\n| stage | units | plan s | inputs of every unit, block reads: s (reads) | one read per unit: s per read | "
          "one read per unit: all units, s (extrapolated) | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, plan_s, r in rows:
        print(f"| {name} | {r['units']:,} | {plan_s:.1f} | {r['blocked_s']:.1f} ({r['reads']}) | {r['per_unit_read_s']:.2f} | "
              f"{r['per_unit_total_s']:.0f} | {r['per_unit_total_s'] / max(r['blocked_s'], 1e-9):.1f}x |")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)  # our own temporary folder


if __name__ == "__main__":
    main()

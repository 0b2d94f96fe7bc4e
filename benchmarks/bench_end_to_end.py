"""End-to-end benchmark on synthetic LongMemEval-format histories at LME-S and LME-m scale, through the job.

Per scale:

1. **the file**: ``synth`` writes a LongMemEval-format file (a share of distractor sessions drawn from a
   shared pool, as LongMemEval haystacks share sessions); not timed.
2. **the job**: ``memgas run`` of ``--config`` (default ``configs/demo.yaml``: every MemGAS and JustMem
   method, LLM-free generator, cards and planner, MiniLM) on that file, reading off, in this process: every
   stage the config enables (ingest, generate, cards, plan, nodes, encode, card-encode, associate, rank,
   card-rank, evaluate ...) as the job runs it, through Ray tasks and actors (``--no-ray``: in-process).
   Printed from the run's own ``metrics.json``: each stage's wall and CPU seconds, items, items/s and peak
   RSS, the whole run's wall time, session references vs unique sessions (dedup saving = 1 - unique /
   references), and the methods scored. Extra ``--set KEY=VALUE`` go to the run, e.g.
   ``--set encoder.model=synthetic`` for a scale run without the encoder model (its retrieval numbers mean
   nothing; its stage times are the job's).
3. **model stages on a sample** (the run's generator and encoder, library calls): ``--sample-sessions``
   unique sessions are generated and every text they need (session, turn pairs, summary, keywords, hybrid)
   is encoded; the per-session time is extrapolated to the split's unique sessions (what memgas does) vs
   all session references (what a pipeline without deduplication would do).

Exit 1 if the run fails, or if a stage the run recorded as executed has no profile or a method no metrics.

    python benchmarks/bench_end_to_end.py                       # LME-S scale: 500 questions x 50 sessions
    python benchmarks/bench_end_to_end.py --scale m --questions 20   # LME-m sessions, fewer questions
    python benchmarks/bench_end_to_end.py --scale both --no-ray

The work directory (default a fresh temp dir, removed at the end unless ``--keep``) holds the synthetic
file and the run; each scale starts from an empty run directory.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCALES = {"s": (500, 50), "m": (500, 500)}  # (questions, sessions per history), as LongMemEval-S / -M

for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_k, _v)


@dataclass
class Row:
    stage: str
    items: float
    unit: str
    seconds: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class Result:
    label: str
    rows: list[Row] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)


# -- helpers --------------------------------------------------------------------------------------------
def run_job(work: Path, args: argparse.Namespace) -> Path:
    """``memgas run`` of the config on the synthetic file, in this process; the run directory."""
    from memgas.jobs.cli import main as cli_main

    out = work / "run"
    sets = [f"output_dir={out}", "data.format=longmemeval", f"data.path={work / 'synth.json'}",
            f"ray.shard_size={args.shard_size}", "retrieval.device=cpu", "evaluation.plots=false",
            "reading.enabled=false",  # no LLM here: retrieval is what this measures
            *args.set]
    argv = ["-q", "run", str(args.config), *(x for kv in sets for x in ("--set", kv))]
    if args.no_ray:
        argv.append("--no-ray")
    code = cli_main(argv)
    if code:
        raise SystemExit(f"memgas {' '.join(argv)} failed (exit {code})")
    return out


def _fmt_s(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.1f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def say(msg: str) -> None:
    print(msg, flush=True)


# -- parts 1 and 2: the file, the job ----------------------------------------------------------------------
def part_job(res: Result, work: Path, questions: int, sessions: int, args: argparse.Namespace) -> dict:
    from memgas.pipeline.data.synth import synth

    path = work / "synth.json"
    t0 = time.perf_counter()
    synth(path, questions=questions, sessions_per_history=sessions, reuse_share=args.reuse_share, seed=args.seed)
    mb = path.stat().st_size / 1e6
    say(f"  synth: {questions} questions x {sessions} sessions, {mb:.1f} MB in {time.perf_counter() - t0:.1f} s "
        "(not timed below)")
    t0 = time.perf_counter()
    run = run_job(work, args)
    wall = time.perf_counter() - t0
    m = json.loads((run / "metrics.json").read_text())
    executed = [r["stage"] for r in m["record"] if r.get("status") == "executed"]
    missing = [st for st in executed if st not in m["stages"]]
    from memgas.pipeline.config import MemgasConfig

    cfg = MemgasConfig.load(run / "config.yaml")
    scored = m["retrieval"].get("session", {})
    unscored = [x for x in cfg.retrieval.methods if x not in scored]
    for name in executed:
        st = m["stages"].get(name)
        if st:
            res.rows.append(Row(name, st["items"], "items", st["wall_s"],
                                f"cpu {st['cpu_s']:.1f} s, peak RSS {st['peak_rss_mb'] or 0:.0f} MB"))
    res.rows.append(Row("memgas run (whole)", questions, "questions", wall, f"{len(executed)} stages executed"))
    c = m["dataset"]["counts"]
    refs, uniq = c["sessions"], c["unique_sessions"]
    res.facts += [
        ("file", f"{mb:.1f} MB, {questions} questions x {sessions} sessions, reuse_share={args.reuse_share}"),
        ("session references / unique sessions", f"{refs} / {uniq}"),
        ("dedup saving (1 - unique/refs)", f"{1 - uniq / max(refs, 1):.1%}"),
        ("unique texts / turn pairs", f"{c['texts']} / {c['pairs']}"),
        ("encoder / generator", f"{m['run']['encoder']} / {m['run']['generator']}"),
        ("methods scored (session level)", f"{len(scored)}: {', '.join(scored)}"),
    ]
    if missing or unscored:
        print_result(res)
        raise SystemExit(f"the run's metrics.json lacks stages {missing} / methods {unscored}")
    return {"cfg": cfg, "sessions": refs, "unique_sessions": uniq, "queries": c["queries"]}


# -- part 3: model stages on a sample ------------------------------------------------------------------------
def part_models(cfg, res: Result, n_sample: int, refs: int, uniq: int, n_queries: int, seed: int) -> None:
    import pyarrow.compute as pc

    from memgas.pipeline.bank import Bank
    from memgas.pipeline.encode import encode_texts
    from memgas.pipeline.generate import derived_texts, generate_for_sessions
    from memgas.pipeline.models.factory import make_encoder
    from memgas.pipeline.prompts import dialogue_kind_for

    bank = Bank(cfg.bank_path)
    hashes = sorted(set(bank.read("sessions", ["text_hash"]).column("text_hash").to_pylist()))
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(hashes), size=min(n_sample, len(hashes)), replace=False).tolist())
    sample = [hashes[i] for i in pick]
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sample))
    stext = dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))
    pairs = bank.read("pairs", ["text_hash"], filter=pc.field("session_hash").isin(sample))
    ph = sorted(set(pairs.column("text_hash").to_pylist()))
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(ph))
    ptext = t.column("text").to_pylist()
    qs = bank.read("queries", ["question"]).column("question").to_pylist()[:100]

    t0 = time.perf_counter()
    encoder = make_encoder(cfg.encoder)
    encoder.encode(["warm-up"])
    t_load = time.perf_counter() - t0
    res.rows.append(Row("model load: MiniLM (overhead)", 1, "load", t_load, f"device={cfg.encoder.device}"))

    kind = dialogue_kind_for("longmemeval")
    items = [(h, stext[h], kind, None) for h in sample]
    t0 = time.perf_counter()
    from memgas.jobs.stage import StageContext
    from memgas.jobs.keys import generation_key
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.pipeline.llm_free import LLMFreeGenerator

    gctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(gctx)
    gens = generate_for_sessions(items, None, cfg.generation, key=generation_key(gctx), llm_free=LLMFreeGenerator())
    derived = derived_texts(gens, stext)
    t_gen = time.perf_counter() - t0
    res.rows.append(Row("generate, LLM-free (sample)", len(sample), "sessions", t_gen, f"{gens.num_rows} outputs"))

    texts = [stext[h] for h in sample] + ptext + derived.column("text").to_pylist()
    t0 = time.perf_counter()
    encode_texts(encoder, texts)
    t_enc = time.perf_counter() - t0
    res.rows.append(Row("encode MiniLM (sample texts)", len(texts), "texts", t_enc,
                        f"{len(texts) / len(sample):.1f} texts/session"))
    t0 = time.perf_counter()
    encode_texts(encoder, qs)
    t_q = time.perf_counter() - t0
    res.rows.append(Row("encode MiniLM (questions)", len(qs), "questions", t_q))

    per = (t_gen + t_enc) / len(sample)
    q_all = t_q / max(len(qs), 1) * n_queries
    with_dedup = per * uniq + q_all
    without = per * refs + q_all
    res.facts += [
        ("model time / session (gen + encode)", f"{per * 1000:.0f} ms on this machine"),
        ("est. model time, unique sessions (memgas)", _fmt_s(with_dedup)),
        ("est. model time, every session reference", _fmt_s(without)),
        ("model-time dedup saving", f"{1 - with_dedup / max(without, 1e-9):.1%} ({without / max(with_dedup, 1e-9):.2f}x)"),
    ]


# -- driver -------------------------------------------------------------------------------------------------
def run_scale(label: str, questions: int, sessions: int, args, base: Path) -> Result:
    res = Result(f"{label}: {questions} questions x {sessions} sessions")
    say(f"\n== {res.label} ==")
    work = base / label
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    summ = part_job(res, work, questions, sessions, args)
    if args.sample_sessions > 0:
        cfg = summ["cfg"]
        part_models(cfg, res, args.sample_sessions, summ["sessions"], summ["unique_sessions"], summ["queries"], args.seed)
    print_result(res)
    return res


def print_result(res: Result) -> None:
    say(f"\n{res.label}")
    say(f"  {'stage':32} {'items':>10} {'unit':>10} {'seconds':>9} {'items/s':>11}  note")
    for r in res.rows:
        items = f"{r.items:.1f}" if r.unit == "MB" else f"{int(r.items)}"
        say(f"  {r.stage:32} {items:>10} {r.unit:>10} {r.seconds:9.2f} {r.rate:11.1f}  {r.note}")
    for k, v in res.facts:
        say(f"  {k:42} {v}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["s", "m", "both"], default="s",
                    help="s = 500 questions x 50 sessions (LME-S), m = 500 x 500 (LME-M); default s")
    ap.add_argument("--questions", type=int, default=None, help="override the number of questions")
    ap.add_argument("--sessions", type=int, default=None, help="override sessions per history")
    ap.add_argument("--reuse-share", type=float, default=0.5, help="share of distractors from the shared pool")
    ap.add_argument("--sample-sessions", type=int, default=40,
                    help="unique sessions for the model-stage sample (0 = skip the model part)")
    ap.add_argument("--shard-size", type=int, default=16, help="histories per association/ranking task")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir, removed unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (banks, synthetic files)")
    ap.add_argument("--no-ray", action="store_true", help="run every stage in this process")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml", help="the run's config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to memgas run")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    base = args.work_dir or Path(tempfile.mkdtemp(prefix="memgas-bench-e2e-"))
    base.mkdir(parents=True, exist_ok=True)
    say(f"work dir: {base}  (executor: {'in-process' if args.no_ray else 'Ray tasks'}, cores: {os.cpu_count()})")
    results = []
    t0 = time.perf_counter()
    try:
        for sc in (["s", "m"] if args.scale == "both" else [args.scale]):
            q, s = SCALES[sc]
            results.append(run_scale(f"LME-{sc}", args.questions or q, args.sessions or s, args, base))
    finally:
        if not args.no_ray:
            from memgas.jobs.ray_session import shutdown_ray

            shutdown_ray()
        if args.work_dir is None and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if len(results) > 1:
        say("\n== summary ==")
        for r in results:
            print_result(r)
    say(f"\ntotal wall time {time.perf_counter() - t0:.0f} s. Reading/answering (LLM) not included; the model "
        "part's times are extrapolated from its sample.")


if __name__ == "__main__":
    main()

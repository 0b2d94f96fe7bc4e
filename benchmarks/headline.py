"""The README's headline table: MemGAS and JustMem side by side, through the real job, with today's defaults.

    .venv/bin/python benchmarks/headline.py configs/demo.yaml                 # the bundled sample
    .venv/bin/python benchmarks/headline.py configs/locomo.yaml               # full LoCoMo (needs the file)
    .venv/bin/python benchmarks/headline.py configs/longmemeval_s.yaml        # the LongMemEval-S split
    .venv/bin/python benchmarks/headline.py --run runs/locomo                 # a finished run, not run again

Runs ``memgas run CONFIG`` with reading off (retrieval is what the table compares; reading on CPU is a
135M-parameter model, docs/benchmarks.md) into ``--out`` (default ``runs/headline-<config name>``), then
prints one Markdown row per method from its ``metrics.json``: session-level R_all@5 and NDCG@10 (%,
LongMemEval's definitions, pipeline/evaluate/retrieval.py), the questions scored, the commit and the date.
The numbers are the job's own: nothing here computes a metric. Extra ``--set`` values go to the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the rows of the README's table: the MemGAS method, its best single granularity and ablation on
#: LoCoMo, the JustMem family and its planner-free ranking
METHODS = ("session", "turn", "hybrid", "memgas", "memgas-no-ppr", "cards", "justmem")


def run_job(config: str, out: Path, sets: list[str]) -> None:
    exe = str(Path(sys.executable).with_name("memgas"))
    args = [exe, "run", config, "--set", f"output_dir={out}", "--set", "reading.enabled=false",
            "--set", f"retrieval.methods=[{','.join(METHODS)}]"]
    for s in sets:
        args += ["--set", s]
    print("$", " ".join(args[1:]), file=sys.stderr)
    subprocess.run(args, cwd=REPO, check=True)


def rows(metrics: dict) -> list[tuple[str, float, float, int]]:
    """(method, R_all@5 %, NDCG@10 %, questions scored) for every method of ``METHODS`` in the run."""
    out = []
    session = metrics["retrieval"]["session"]
    for m in METHODS:
        if m in session:
            overall = session[m]["overall"]
            out.append((m, 100 * overall["recall_all@5"], 100 * overall["ndcg@10"], int(session[m]["n_evaluated"])))
    return out


def synthetic_refusal(config: str | None, sets: list[str], metrics: dict | None) -> str | None:
    """Why this table must not be printed (None: it may): a run with the synthetic encoder (vectors from
    hashes, pipeline/models/synthetic.py) has retrieval numbers that measure nothing."""
    from memgas.pipeline.config import MemgasConfig
    from memgas.pipeline.models.synthetic import SYNTHETIC_MODEL, is_synthetic

    what = None
    if metrics is not None:
        encoder = str((metrics.get("run") or {}).get("encoder") or "")
        if metrics.get("synthetic_encoder") or encoder.startswith(f"{SYNTHETIC_MODEL}@"):
            what = "the run used encoder.model=synthetic"
    elif is_synthetic(MemgasConfig.load(config, sets).encoder.model):
        what = f"{config} {' '.join(sets)}".strip() + " sets encoder.model=synthetic"
    if what is None:
        return None
    return f"headline.py: {what}: vectors from text hashes make every quality number meaningless; refused"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a config of configs/ (omit with --run)")
    ap.add_argument("--run", type=Path, help="read this finished run directory instead of running")
    ap.add_argument("--out", type=Path, help="run directory (default runs/headline-<config name>)")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to memgas run")
    args = ap.parse_args(argv)
    if args.run is None and args.config is None:
        ap.error("give a config or --run")
    run_dir = args.run
    from memgas.pipeline.errors import ConfigError

    try:
        refusal = synthetic_refusal(args.config, args.set, None) if run_dir is None else None
    except ConfigError as exc:  # the run would refuse it too: say so before starting it
        print(f"headline.py: {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if run_dir is None:
        run_dir = args.out or REPO / "runs" / f"headline-{Path(args.config).stem}"
        t0 = time.perf_counter()
        run_job(args.config, run_dir, args.set)
        print(f"memgas run: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    refusal = synthetic_refusal(None, [], metrics)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    commit = (metrics.get("run") or {}).get("git_commit") or "?"
    print(f"{run_dir}: commit {commit}, {time.strftime('%Y-%m-%d')}")
    print("| method | R_all@5 | NDCG@10 | questions |")
    print("|---|---|---|---|")
    for m, r5, n10, n in rows(metrics):
        print(f"| {m} | {r5:.1f} | {n10:.1f} | {n} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""memgas-cards on one huge history through the job: ``memgas index``, an append of ``--append`` sessions, and
``memgas answer``, without the models.

One synthetic history of ``--sessions`` sessions (four utterances each, every text unique:
``huge_history_job.write_history``) and 20 seeded questions; ``encoder.model: synthetic`` (vectors from the
texts' hashes: the retrieval numbers mean nothing, the work is the real one), the LLM-free generator and card
extractor, ``retrieval.methods: [memgas-cards]`` (the card graph: each session's four nodes and its cards),
``association.search: ivf``, push PPR, reading off. Each command runs as a child process (Ray with
``--ray-cpus``; ``huge_history_job.command``: its wall time and ``ru_maxrss``):

1. ``memgas ingest`` of the sessions, ``memgas index`` (the fresh build);
2. ``memgas ingest --append`` of ``--append`` more, ``memgas index`` (the append: only the new rows);
3. ``memgas answer`` (card-graph-rank, evaluate).

Baseline, measured in the same run with ``--fresh`` (default up to 20,000 sessions): a second bank with both
files ingested and indexed once. Printed: each command's time, the append's index against that fresh index of
the grown history (the ratio), and the check on the same inputs: both banks' ``card_graph_edges`` equal row for
row (similarities compared exactly). Exit 1 if they differ. Without ``--fresh`` the ratio is against the first
build (of the shorter history), and no check is made.

    python benchmarks/bench_cards_history.py --sessions 100000 --append 1000 --no-fresh
    python benchmarks/bench_cards_history.py --sessions 10000 --append 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import huge_history_job as J

#: sessions up to which ``--fresh`` is the default (a second build of the grown history)
FRESH_UP_TO = 20_000


def write_config(path: Path, work: Path, ray_cpus: int, extra: list[str]) -> Path:
    """The config of both banks (``bank_dir`` is set per command)."""
    lines = ["name: cards-history", f"output_dir: {work / 'run'}",
             "data:", f"  path: {work / 'a.jsonl'}", "  format: jsonl",
             "encoder:", "  model: synthetic", "generation:", "  generator: llm-free",
             "association:", "  search: ivf",
             "retrieval:", "  device: cpu", "  methods: [memgas-cards]", "  ppr: push",
             "reading:", "  enabled: false", "evaluation:", "  plots: false",
             "ray:", f"  num_cpus: {ray_cpus}", "  shard_size: 1", ""]
    path.write_text("\n".join(lines))
    return path


def stage_walls(bank: Path) -> dict[str, float]:
    """The last ``memgas index``'s executed stages and their wall seconds (the bank's manifest)."""
    m = json.loads((bank / "manifest.json").read_text())["index"]
    ran = {e["stage"] for e in m["record"] if e.get("status") == "executed"}
    return {s: round(v["wall_s"], 1) for s, v in m["stages"].items() if s in ran}


def edges(bank: Path) -> list[tuple]:
    from memgas.pipeline.bank import Bank

    t = Bank(bank).read("card_graph_edges")
    cols = ("history_id", "mode", "src", "dst", "similarity")
    return sorted(zip(*(t[c].to_pylist() for c in cols)))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    S = args.sessions
    J.write_history(work / "a.jsonl", 0, S, J.question_sessions(S, 20, args.seed))
    J.write_history(work / "b.jsonl", S, S + args.append, [])
    cfg = str(write_config(work / "config.yaml", work, args.ray_cpus, args.set))
    sets = [x for s in args.set for x in ("--set", s)] + (["--no-ray"] if args.no_ray else [])
    log = work / "commands.log"

    def cmd(*argv: str) -> dict[str, Any]:
        return J.command([*argv], log, in_process=args.in_process)

    def index(bank: Path) -> dict[str, Any]:
        return {**cmd("index", str(bank), "-c", cfg, *sets), "stages": stage_walls(bank)}

    grown, out = work / "bank", {"sessions": S, "append": args.append}
    out["ingest"] = cmd("ingest", str(work / "a.jsonl"), "--format", "jsonl", "--out", str(grown))
    out["index"] = index(grown)
    out["append_ingest"] = cmd("ingest", str(work / "b.jsonl"), "--format", "jsonl", "--append", "--out", str(grown))
    out["append_index"] = index(grown)
    out["answer"] = cmd("answer", str(grown), "-c", cfg, *sets, "--out", str(work / "run"))
    metrics = json.loads((work / "run" / "metrics.json").read_text())
    out["answer"]["stages"] = {k: round(v["wall_s"], 1) for k, v in metrics["stages"].items()}
    if args.fresh:
        one = work / "fresh"
        cmd("ingest", str(work / "a.jsonl"), "--format", "jsonl", "--out", str(one))
        cmd("ingest", str(work / "b.jsonl"), "--format", "jsonl", "--append", "--out", str(one))
        out["fresh_index"] = index(one)
        out["edges_equal"] = edges(grown) == edges(one)
    base = out["fresh_index" if args.fresh else "index"]["wall_s"]
    out["ratio"] = out["append_index"]["wall_s"] / base
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10_000, help="sessions of the history (default 10,000)")
    ap.add_argument("--append", type=int, default=1000, help="sessions appended (default 1,000)")
    ap.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=None,
                    help=f"also build the grown history at once and compare the edges (default: up to "
                         f"{FRESH_UP_TO:,} sessions)")
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true", help="every command with --no-ray")
    ap.add_argument("--in-process", action="store_true", help="commands in this process (no RSS of their own)")
    ap.add_argument("--set", action="append", default=[], help="a config override for every command")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp", type=Path, help="work directory (default: a temporary one, deleted)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.fresh is None:
        args.fresh = args.sessions <= FRESH_UP_TO
    if args.tmp is not None:
        args.tmp.mkdir(parents=True, exist_ok=True)
        out = run(args, args.tmp)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-cards-") as d:
            out = run(args, Path(d))
    print(f"memgas-cards, one history of {out['sessions']:,} sessions (+{out['append']:,})")
    print("| command | wall s | ru_maxrss GB | stages (wall s) |")
    print("|---|---|---|---|")
    for k in ("ingest", "index", "append_ingest", "append_index", "answer", "fresh_index"):
        if k in out:
            r = out[k]
            rss = "-" if r.get("maxrss_gb") is None else f"{r['maxrss_gb']:.2f}"
            print(f"| {k} | {r['wall_s']:.1f} | {rss} | {r.get('stages', '')} |")
    base = "the grown history's fresh index" if args.fresh else "the first index"
    print(f"append index / {base}: {out['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.fresh:
        print(f"append's card_graph_edges == fresh build's: {out['edges_equal']}")
        return 0 if out["edges_equal"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

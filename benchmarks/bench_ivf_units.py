"""One IVF history through the associate stage: one unit against units of ``--unit`` sessions.

A bank of one seeded history (``tests/jobs/test_node_blocks.seeded_bank``: synthetic 384-d vectors written
into the nodes, pairs and embeddings tables, no encoder) is associated in-process through the runner twice:
with one unit (``segments.IVF_UNIT_SESSIONS`` huge) and cut at every multiple of ``--unit`` sessions. Prints
each run's units, wall and CPU seconds, per-unit seconds and recall, and whether the edges and the saved index
are the same. The units run one after another here: this measures what independent units cost in CPU (each
later one trains the centroids again and adds the nodes before its rows), not the wall time of a cluster.

    .venv/bin/python benchmarks/bench_ivf_units.py --sessions 16384 --unit 4096
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "jobs"))

from test_node_blocks import associate_ctx, associate_rows, run_associate, seeded_bank  # noqa: E402

from memgas.pipeline.association import segments  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16384)
    ap.add_argument("--unit", type=int, default=4096, help="sessions per unit of the cut run")
    ap.add_argument("--exact-nodes", type=int, default=8192)
    ap.add_argument("--nlist", type=int, default=128)
    ap.add_argument("--nprobe", type=int, default=4)
    ap.add_argument("--tmp", default=None)
    args = ap.parse_args(argv)
    assoc = {"search": "ivf", "ivf_exact_nodes": args.exact_nodes, "ivf_nlist": args.nlist, "ivf_nprobe": args.nprobe}
    d = Path(tempfile.mkdtemp(dir=args.tmp))
    unit_sessions = segments.IVF_UNIT_SESSIONS
    rows = {}
    try:
        warm_sessions = min(600, args.sessions)  # untimed: lazy imports and faiss's first calls
        warm, _ = seeded_bank(d / "warm", {"h": warm_sessions}, dim=384)
        run_associate(associate_ctx(warm, {**assoc, "ivf_exact_nodes": 4 * warm_sessions // 3, "ivf_nlist": 8}))
        for name, unit in (("one unit", 1 << 40), (f"units of {args.unit}", args.unit)):
            segments.IVF_UNIT_SESSIONS = unit
            bank, _ = seeded_bank(d / str(unit), {"h": args.sessions}, dim=384)
            ctx = associate_ctx(bank, assoc)
            c0, t0 = time.process_time(), time.time()
            units, stats = run_associate(ctx)
            print(name, {"units": [s[1:3] for u in units for s in u["segments"]], "wall_s": round(time.time() - t0, 1),
                         "cpu_s": round(time.process_time() - c0, 1),
                         "unit_s": [round(s, 1) for _, s in ctx.unit_seconds["associate"]],
                         "recall": stats.get("ivf_recall")}, flush=True)
            rows[name] = associate_rows(bank)
        one, cut = rows.values()
        same = (one["edges"] == cut["edges"], one["ivf_index"] == cut["ivf_index"])
        print("edges equal:", same[0], "saved index equal:", same[1])
        if not all(same):
            raise SystemExit("the cut run's edges or saved index differ from the one-unit run's")
    finally:
        segments.IVF_UNIT_SESSIONS = unit_sessions  # the module's own value again (main may run in a test)
        shutil.rmtree(d)


if __name__ == "__main__":
    main()

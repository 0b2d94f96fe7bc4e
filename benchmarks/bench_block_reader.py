"""The node-block reader of a long history: blocks gathered from slots kept once (today's
``HistoryBlockReader``) against a MatrixLoader per block (the reader before, which read ``nodes`` and
``pairs`` again for every block), on a bank of one long history such as ``bench_huge_history.py
--through-job --keep`` leaves.

Each reader runs in a process of its own (its ``ru_maxrss`` is its own), reads every block of the history,
and hashes the blocks' bytes; the bench prints both times, the ratio and whether the digests are equal
(they must be: it exits 1 otherwise).

    .venv/bin/python benchmarks/bench_block_reader.py --work /tmp/h5/n100000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def gathered(bank: Any, keys: dict[str, str], history: str) -> Any:
    """The reader before's one pass: every vector the history needs, spilled (no slots kept)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs.history_index import READ_BATCH_ROWS
    from memgas.pipeline.spilled_vectors import SpilledVectors

    nodes = bank.read("nodes", ["granularity", "text_hash"], batch_rows=READ_BATCH_ROWS,
                      filter=pc.field("history_id") == history)
    gran = nodes["granularity"]
    sessions = nodes.filter(pc.equal(gran, "session"))["text_hash"]
    pairs = bank.read("pairs", ["session_hash", "text_hash"], batch_rows=READ_BATCH_ROWS,
                      filter=pc.field("session_hash").isin(pc.unique(sessions)))
    by_role = {"main": nodes.filter(pc.invert(pc.is_in(gran, pa.array(["session", "turn"]))))["text_hash"],
               "session": sessions, "pair": pairs["text_hash"]}
    need: dict[str, list] = {}
    for role, hashes in by_role.items():
        need.setdefault(keys[role], []).extend(hashes.chunks)
    return SpilledVectors(bank, {k: pa.chunked_array(c, pa.string()) for k, c in need.items()})


def read_all(work: Path, history: str, mode: str) -> dict[str, Any]:
    """Read every node block of ``history`` with the reader ``mode`` (``slots`` or ``loader``)."""
    import numpy as np
    import pyarrow.compute as pc

    from memgas.jobs.keys import encoder_keys
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.jobs.stage import StageContext
    from memgas.jobs.history_index import READ_BATCH_ROWS, HistoryBlockReader
    from memgas.jobs.stages.shards import node_matrix
    from memgas.pipeline.association import blocks
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.config import MemgasConfig
    from memgas.pipeline.granularity import MatrixLoader

    cfg = MemgasConfig.load(work / "config.yaml", [])
    bank = Bank(cfg.bank_path)
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    keys = encoder_keys(ctx)
    t0 = time.perf_counter()
    reader = HistoryBlockReader(bank, keys, history, blocks.BLOCK_ROWS)
    n_blocks = -(-reader.n_sessions * 4 // blocks.BLOCK_ROWS)
    digest = hashlib.sha256()
    if mode == "slots":
        for i in range(n_blocks):
            digest.update(reader.read(i).tobytes())
    else:  # the reader before: the same gathered vectors, then nodes by position range and a MatrixLoader per block
        vectors = gathered(bank, keys, history)
        bs = reader.block_sessions
        for i in range(n_blocks):
            s0, s1 = i * bs, min(reader.n_sessions, (i + 1) * bs)
            lo, hi = int(reader.positions[s0]), int(reader.positions[s1 - 1])
            nodes = bank.read("nodes", batch_rows=READ_BATCH_ROWS, filter=(pc.field("history_id") == history)
                              & (pc.field("position") >= lo) & (pc.field("position") <= hi))
            loader = MatrixLoader(bank, keys["main"], nodes=nodes, pair_encoder=keys["pair"],
                                  session_encoder=keys["session"], batch_rows=READ_BATCH_ROWS, vectors=vectors)
            digest.update(np.ascontiguousarray(node_matrix(loader.get(history))).tobytes())
    return {"mode": mode, "blocks": n_blocks, "sessions": reader.n_sessions, "seconds": time.perf_counter() - t0,
            "ru_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "sha256": digest.hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a directory with the bank's config.yaml")
    ap.add_argument("--history", default="h0", help="the history to read (bench_huge_history's is h0)")
    ap.add_argument("--mode", choices=["slots", "loader"], help=argparse.SUPPRESS)  # one reader, in a child
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(read_all(args.work, args.history, args.mode)))
        return 0
    out = {}
    for mode in ("loader", "slots"):
        p = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--history", args.history,
                            "--mode", mode], capture_output=True, text=True)
        if p.returncode:
            print(p.stderr[-3000:], file=sys.stderr)
            return p.returncode
        out[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"{mode:7s} {out[mode]['seconds']:8.1f} s  ru_maxrss {out[mode]['ru_maxrss_gb']:.2f} GB  "
              f"{out[mode]['blocks']} blocks of {out[mode]['sessions']} sessions")
    same = out["slots"]["sha256"] == out["loader"]["sha256"]
    print(f"slots vs a MatrixLoader per block: {out['loader']['seconds'] / out['slots']['seconds']:.2f}x faster; "
          f"blocks byte-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

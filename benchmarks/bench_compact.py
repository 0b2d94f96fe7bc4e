"""Compaction of a content table: the streamed merge (today's ``Bank.compact``) against the in-memory
compaction it replaced (every part read, de-duplicated, sorted, written at once), on a copy of one table.

The table is either made here (``--parts`` parts of ``--rows`` random 384-d vectors, every fourth part out
of key order, as units of the encode stage would write them plus a few that are not) or copied from a bank
(``--bank``, e.g. the 10^6-session bank that ``bench_huge_history.py --through-job --keep`` leaves). Each
compaction runs in a process of its own, on its own copy, and reports its wall time and ``ru_maxrss``; the
bench prints both, their ratio, and whether the two compacted parts are the same bytes (they must be: it
exits 1 otherwise). ``--streamed-only`` skips the in-memory one, for a table that it cannot hold.

    .venv/bin/python benchmarks/bench_compact.py --parts 32 --rows 16000 --work /tmp/bench-compact
    .venv/bin/python benchmarks/bench_compact.py --bank /tmp/h6/n1000000/bank --streamed-only --work /tmp/bc
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from memgas.pipeline.bank import Bank, COMPACT_PREFIX, key_order
bank, mode = Bank(sys.argv[1]), sys.argv[2]
own = bank.parts(sys.argv[3])
start = time.perf_counter()
if mode == "streamed":
    rows = bank.compact(sys.argv[3])
else:  # the compaction before: Bank.read of every part (dedupe_last), key_order, Bank.write
    table = key_order(sys.argv[3], bank.read(sys.argv[3], parts=own))
    bank.write(sys.argv[3], table)
    rows = table.num_rows
wall = time.perf_counter() - start
(part,) = [p for p in bank.parts(sys.argv[3]) if p.startswith(COMPACT_PREFIX)]
print(json.dumps({"mode": mode, "rows": rows, "wall_s": wall, "part": part,
                  "ru_maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def make_table(bank_dir: Path, parts: int, rows: int, dim: int = 384) -> None:
    import numpy as np
    import pyarrow as pa

    from memgas.pipeline.bank import Bank

    bank = Bank.create(bank_dir)
    rng = np.random.default_rng(0)
    for i in range(parts):
        hashes = [f"{x:016x}" for x in rng.integers(0, 2**62, rows)]
        vecs = rng.standard_normal((rows, dim)).astype(np.float32)
        t = pa.table({"text_hash": pa.array(hashes), "encoder": pa.array(["enc"] * rows),
                      "vector": pa.FixedSizeListArray.from_arrays(pa.array(vecs.ravel()), dim),
                      "truncated": pa.array([False] * rows), "tokens": pa.array(np.ones(rows, np.int32)),
                      "tokens_dropped": pa.array(np.zeros(rows, np.int32))})
        if i % 4 != 3:
            t = t.sort_by([("text_hash", "ascending")])
        bank.write_part("embeddings", f"unit-{i:05d}", t)


def copy_table(src: Path, dst: Path, table: str) -> None:
    """A bank of one table: its parts and markers (and the manifest, which Bank needs)."""
    dst.mkdir(parents=True)
    shutil.copy2(src / "manifest.json", dst / "manifest.json")
    shutil.copytree(src / table, dst / table)


def run(bank_dir: Path, mode: str, table: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(bank_dir), mode, table], capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"{mode} compaction failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (deleted first)")
    ap.add_argument("--parts", type=int, default=32, help="parts of the made table")
    ap.add_argument("--rows", type=int, default=16000, help="rows per part of the made table")
    ap.add_argument("--bank", type=Path, help="copy this bank's table instead of making one")
    ap.add_argument("--table", default="embeddings")
    ap.add_argument("--streamed-only", action="store_true", help="skip the in-memory compaction")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    source = args.work / "source"
    if args.bank:
        copy_table(args.bank, source, args.table)
    else:
        make_table(source, args.parts, args.rows)
    results = {}
    for mode in ["streamed"] + ([] if args.streamed_only else ["in-memory"]):
        work = args.work / mode
        copy_table(source, work, args.table)
        results[mode] = run(work, mode, args.table)
        path = work / args.table / f"{results[mode]['part']}.parquet"
        results[mode]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        results[mode]["gb"] = path.stat().st_size / 1e9
        shutil.rmtree(work)
        print(json.dumps(results[mode]), flush=True)
    s = results["streamed"]
    print(f"\n| compaction | rows | wall | ru_maxrss |\n|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['rows']:,} | {r['wall_s']:.1f} s | {r['ru_maxrss_gb']:.2f} GB |")
    if "in-memory" in results:
        m = results["in-memory"]
        same = m["sha256"] == s["sha256"]
        print(f"\nspeed-up {m['wall_s'] / s['wall_s']:.2f}x, memory {m['ru_maxrss_gb'] / s['ru_maxrss_gb']:.2f}x "
              f"less; the same bytes: {'yes' if same else 'NO'}")
        if not same:
            sys.exit(1)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

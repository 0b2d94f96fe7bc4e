"""Compaction of a content table: the streamed merge (today's ``Bank.compact``) against the in-memory
compaction it replaced (every part read, de-duplicated, sorted, written at once), on a copy of one table.

The table is either made here (``--parts`` parts of ``--rows`` random 384-d vectors, every fourth part out
of key order, as units of the encode stage would write them plus a few that are not) or copied from a bank
(``--bank``, e.g. the 10^6-session bank that ``bench_huge_history.py --through-job --keep`` leaves). Each
compaction runs in a process of its own, on its own copy, and reports its wall time and ``ru_maxrss``; the
bench prints both, their ratio, and whether the two compacted parts are the same bytes (they must be: it
exits 1 otherwise). ``--streamed-only`` skips the in-memory one, for a table that it cannot hold.
``--append-parts``: the made table is compacted first and new parts follow, as after an append; today's
compaction then leaves the large part alone (tiered), so it is compared by the rows it reads (a digest over
the merged rows), and also against ``untiered`` (every part merged, as before tiers).

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
from memgas.jobs.stage import values_digest
from memgas.pipeline import bank as B
from memgas.pipeline.compaction import regroup
bank, mode, name = B.Bank(sys.argv[1]), sys.argv[2], sys.argv[3]
own = bank.parts(name)
start = time.perf_counter()
if mode in ("streamed", "untiered"):
    if mode == "untiered":  # every part merged, as before tiers (the ratio of the module that compacts)
        sys.modules[B.Bank.compact.__module__].TIER_RATIO = float("inf")
    rows = bank.compact(name)
else:  # the compaction before: Bank.read of every part (dedupe_last), key_order, Bank.write
    table = B.key_order(name, bank.read(name, parts=own))
    bank.write(name, table)
    rows = table.num_rows
wall = time.perf_counter() - start
maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
parts = bank.parts(name)
# the rows as readers see them, whatever the parts (not timed)
digest = values_digest(regroup(bank.iter_merged(name), 8192))
print(json.dumps({"mode": mode, "rows": rows, "wall_s": wall, "parts": parts, "rows_digest": digest,
                  "ru_maxrss_gb": maxrss}))
"""


def make_table(bank_dir: Path, parts: int, rows: int, dim: int = 384, append_parts: int = 0,
               append_rows: int = 0) -> None:
    """``parts`` parts of ``rows`` rows; with ``append_parts``, those are compacted first (the table after an
    index) and ``append_parts`` parts of ``append_rows`` new rows follow (an append's units)."""
    import numpy as np
    import pyarrow as pa

    from memgas.pipeline.bank import Bank

    bank = Bank.create(bank_dir)
    rng = np.random.default_rng(0)
    for i in range(parts + append_parts):
        if i == parts and append_parts:
            bank.compact("embeddings")
            rows = append_rows
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


def sha256(path: Path) -> str:
    """In 1 MiB reads: the bench's own RSS is where the next child's ``ru_maxrss`` starts."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(bank_dir: Path, mode: str, table: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(bank_dir), mode, table], capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"{mode} compaction failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (deleted first)")
    ap.add_argument("--parts", type=int, default=32, help="parts of the made table")
    ap.add_argument("--rows", type=int, default=16000, help="rows per part of the made table")
    ap.add_argument("--append-parts", type=int, default=0,
                    help="compact the made table first, then add this many parts of new rows (an append)")
    ap.add_argument("--append-rows", type=int, default=512, help="rows per appended part")
    ap.add_argument("--bank", type=Path, help="copy this bank's table instead of making one")
    ap.add_argument("--table", default="embeddings")
    ap.add_argument("--streamed-only", action="store_true", help="skip the in-memory compaction")
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    source = args.work / "source"
    if args.bank:
        copy_table(args.bank, source, args.table)
    else:  # in a process of its own: on Linux a child's ru_maxrss starts at its parent's (fork, then exec)
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_compact as b; "
                f"from pathlib import Path; b.make_table(Path({str(source)!r}), {args.parts}, {args.rows}, "
                f"append_parts={args.append_parts}, append_rows={args.append_rows})")
        subprocess.run([sys.executable, "-c", code], check=True)
    results = {}
    modes = ["streamed"] + (["untiered"] if args.append_parts else []) + ([] if args.streamed_only else ["in-memory"])
    for mode in modes:
        work = args.work / mode
        copy_table(source, work, args.table)
        results[mode] = run(work, mode, args.table)
        results[mode]["sha256"] = sorted(sha256(work / args.table / f"{p}.parquet") for p in results[mode]["parts"])
        shutil.rmtree(work)
        print(json.dumps(results[mode]), flush=True)
    print(f"\n| compaction | rows | parts after | wall | ru_maxrss |\n|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['rows']:,} | {len(r['parts'])} | {r['wall_s']:.1f} s | {r['ru_maxrss_gb']:.2f} GB |")
    s, ok = results["streamed"], True
    for mode, r in results.items():
        if mode == "streamed":
            continue
        same_rows = r["rows_digest"] == s["rows_digest"]
        same_bytes = r["sha256"] == s["sha256"]
        ok &= same_rows and (same_bytes or len(s["parts"]) > 1)
        print(f"\n{mode} / streamed: {r['wall_s'] / s['wall_s']:.2f}x the time, {r['ru_maxrss_gb'] / s['ru_maxrss_gb']:.2f}x "
              f"the memory; the same rows: {'yes' if same_rows else 'NO'}; the same bytes: {'yes' if same_bytes else 'no'}"
              f"{' (streamed left a compacted part as it was)' if len(s['parts']) > 1 else ''}")
    if not ok:
        sys.exit(1)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()

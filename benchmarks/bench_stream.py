"""Streaming ingest benchmark: peak memory must stay bounded as the input file grows.

Synthesises a LongMemEval-format file of about ``--target-mb`` MB (default 1024), ingests it into a fresh
bank in a child process, and prints the child's peak RSS next to the file size. Run it at two sizes: if
ingest streams, peak RSS barely moves while the file grows (what remains is the set of seen hashes,
~70 bytes per unique text, and one chunk of rows).

    python benchmarks/bench_stream.py --target-mb 200
    python benchmarks/bench_stream.py              # ~1 GB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _hwm_kib() -> int:
    """This process's peak RSS (KiB): ``VmHWM``, the high-water mark of its own memory since exec. Not
    ``ru_maxrss``: Linux starts a child's at its parent's RSS at fork, so a large parent inflated it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (no /proc: an upper bound)


def _child(path: str, bank: str) -> None:
    """Run in a child process so that its peak RSS is the ingest's alone."""
    import logging

    from memgas.pipeline.ingest import ingest

    logging.basicConfig(level=logging.WARNING)
    base = _hwm_kib()
    t0 = time.perf_counter()
    summary = ingest(path, "longmemeval", bank, progress=False)
    secs = time.perf_counter() - t0
    peak = _hwm_kib()
    keys = ("histories", "sessions", "unique_sessions", "texts", "turns", "pairs", "queries", "parts")
    out = {k: summary[k] for k in keys}
    out.update(ingest_s=round(secs, 1), rss_after_import_mb=round(base / 1024, 1), peak_rss_mb=round(peak / 1024, 1))
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-mb", type=float, default=1024.0, help="approximate size of the synthetic file")
    ap.add_argument("--sessions", type=int, default=50, help="sessions per history (LME-S has ~50)")
    ap.add_argument("--turns", type=int, default=10, help="utterances per session")
    ap.add_argument("--reuse-share", type=float, default=0.5)
    ap.add_argument("--workdir", default=None, help="where to put the file and bank (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the file and bank")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        _child(*args._child)
        return

    from memgas.pipeline.data.synth import synth

    work = Path(args.workdir or tempfile.mkdtemp(prefix="memgas-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    probe = synth(work / "probe.json", questions=20, sessions_per_history=args.sessions,
                  turns_per_session=args.turns, reuse_share=args.reuse_share, seed=0)
    per_q = probe.stat().st_size / 20
    probe.unlink()
    n = max(1, round(args.target_mb * 1e6 / per_q))
    path = work / f"synth_{n}q.json"
    t0 = time.perf_counter()
    synth(path, questions=n, sessions_per_history=args.sessions, turns_per_session=args.turns,
          reuse_share=args.reuse_share, seed=0)
    synth_s = time.perf_counter() - t0
    size_mb = path.stat().st_size / 1e6
    bank = work / "bank"
    res = subprocess.run(
        [sys.executable, __file__, "--_child", str(path), str(bank)],
        check=True, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    bank_mb = sum(f.stat().st_size for f in bank.rglob("*.parquet")) / 1e6
    out = {"file_mb": round(size_mb, 1), "questions": n, "synth_s": round(synth_s, 1), **out,
           "ingest_mb_per_s": round(size_mb / out["ingest_s"], 1), "bank_mb": round(bank_mb, 1),
           "peak_rss_over_file": round(out["peak_rss_mb"] / size_mb, 3)}
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(out))
    if not args.keep:
        path.unlink(missing_ok=True)
        import shutil

        shutil.rmtree(bank, ignore_errors=True)


if __name__ == "__main__":
    main()

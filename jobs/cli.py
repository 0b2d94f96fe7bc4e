"""The `memgas` command line. Every subcommand has --help with examples; errors print one line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap

from memgas import __version__
from memgas.pipeline.errors import MemgasError

log = logging.getLogger("memgas")

FORMATS = ["longmemeval", "locomo", "longmtbench", "jsonl"]


def _fmt(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def _add_config_args(p: argparse.ArgumentParser, *, positional: bool) -> None:
    if positional:
        p.add_argument("config", help="YAML config (see configs/; every key has a default in pipeline/config.py)")
    else:
        p.add_argument("--config", "-c", help="YAML config (see configs/)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set retrieval.num_seeds=10 --set llm.backend=openai (repeatable)",
    )
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local embedded Ray)")
    p.add_argument("--no-ray", action="store_true", help="run every stage in this process (debugging)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memgas",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fmt(
            """
            memgas: batch MemGAS pipeline for long-term conversational memory.
            Sessions become four granularities (session, turns, summary, keywords); new memories are
            associated with older ones by a 2-component GMM; queries are routed by entropy and ranked by
            Personalized PageRank over the association graph.

            Typical flow:
              memgas run configs/demo.yaml                     # ingest + index + answer + report
              memgas ingest data.json --format locomo --out bank/
              memgas index bank/ --config configs/locomo.yaml
              memgas answer bank/ --config configs/locomo.yaml --method memgas --method session
              memgas report runs/a runs/b                      # compare runs side by side
            """
        ),
    )
    parser.add_argument("--version", action="version", version=f"memgas {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "ingest", help="load a benchmark or JSONL file into a memory bank (Parquet)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fmt(
            """
            Load a dataset file into a memory bank directory (Parquet tables + manifest.json).
            Large LongMemEval-M files are streamed; memory stays bounded by one question.

            Examples:
              memgas ingest ../shared/data/locomo/locomo10.json --format locomo --out banks/locomo
              memgas ingest longmemeval_s.json --format longmemeval --out banks/lme_s --limit 50
              memgas ingest my_histories.jsonl --format jsonl --out banks/mine --strict
            """
        ),
    )
    p.add_argument("file", help="dataset file (.json or .jsonl)")
    p.add_argument("--format", "-f", required=True, choices=FORMATS, help="dataset format (docs/data.md)")
    p.add_argument("--out", "-o", required=True, help="bank directory to create or replace")
    p.add_argument("--strict", action="store_true", help="turn data warnings (bad dates, dangling evidence) into errors")
    p.add_argument("--limit", type=int, help="only the first N histories/questions")

    p = sub.add_parser(
        "stats", help="describe a memory bank",
        description="Histories, sessions, unique sessions (dedup ratio), turns, queries by type, evidence "
        "coverage and estimated tokens.\n\nExample:\n  memgas stats banks/locomo --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("bank", help="bank directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser(
        "synth", help="write deterministic synthetic LongMemEval-format histories",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fmt(
            """
            Seeded synthetic histories with planted facts and known evidence sessions, for scale tests.

            Examples:
              memgas synth synth_m.json --questions 500 --sessions 500          # LME-m sized
              memgas synth big.json --questions 1 --sessions 100000 --turns 4   # one huge history
            """
        ),
    )
    p.add_argument("out", help="output .json path")
    p.add_argument("--questions", type=int, default=20, help="questions (= histories)")
    p.add_argument("--sessions", type=int, default=40, help="sessions per history")
    p.add_argument("--turns", type=int, default=6, help="utterances per session")
    p.add_argument("--reuse", type=float, default=0.5, help="share of sessions drawn from a pool shared across histories")
    p.add_argument("--multi-session", type=float, default=0.3, help="share of questions whose fact is split over two sessions")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser(
        "index", help="generate summaries/keywords, encode, and build association graphs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fmt(
            """
            unique sessions -> summary + keywords (LLM or LLM-free) -> embeddings -> GMM association per
            history -> Parquet. Cached by content hash: re-running computes only what is missing, and a
            killed run resumes without redoing finished units.

            Example:
              memgas index banks/locomo --config configs/locomo.yaml --set llm.backend=openai
            """
        ),
    )
    p.add_argument("bank", help="bank directory (from `memgas ingest`)")
    _add_config_args(p, positional=False)

    p = sub.add_parser(
        "answer", help="rank sessions, read, answer and evaluate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fmt(
            """
            rank (entropy router + PPR, batched) -> filter -> answer -> evaluate -> report.

            Example:
              memgas answer banks/locomo --config configs/locomo.yaml --method memgas --method session --out runs/x
            """
        ),
    )
    p.add_argument("bank", help="indexed bank directory")
    _add_config_args(p, positional=False)
    p.add_argument("--method", action="append", help="retrieval method (repeatable; default: config's list)")
    p.add_argument("--out", help="run directory for metrics and the report (default: config output_dir)")

    for name, helptext in (
        ("run", "the main job: ingest + index + answer + evaluate + report"),
        ("profile", "the main job with per-stage throughput, latency p50/p95 and a profile report"),
    ):
        p = sub.add_parser(
            name, help=helptext, formatter_class=argparse.RawDescriptionHelpFormatter,
            description=_fmt(
                f"""
                {helptext}.
                Writes into the config's output_dir: bank/, metrics.json, report.md, *.png, manifest.json.

                Examples:
                  memgas {name} configs/demo.yaml
                  memgas {name} configs/locomo.yaml --set reading.max_questions=50
                  RAY_ADDRESS=auto memgas {name} configs/cluster.yaml
                """
            ),
        )
        _add_config_args(p, positional=True)
        p.add_argument("--fresh", action="store_true", help="delete the run's output_dir first")

    p = sub.add_parser(
        "report", help="write or compare reports of finished runs",
        description="With one run directory: (re)write its report.md and plots from metrics.json. With several: "
        "a side-by-side comparison.\n\nExample:\n  memgas report runs/locomo_minilm runs/locomo_contriever --out cmp.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run directories holding metrics.json")
    p.add_argument("--out", help="comparison markdown path (default: print)")

    p = sub.add_parser(
        "serve", help="serve the configured LLM as an OpenAI-compatible HTTP endpoint",
        description="Example:\n  memgas serve --port 8011   # then llm.backend=openai, llm.base_url=http://127.0.0.1:8011/v1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p, positional=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8011)
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "sentence_transformers", "transformers"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    _setup_logging(args)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        return _dispatch(args)
    except MemgasError as exc:
        print(f"memgas {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `memgas stats BANK | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"memgas {args.command}: interrupted; completed units are kept, re-run to resume", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "ingest":
        from memgas.pipeline.ingest import ingest

        summary = ingest(args.file, args.format, args.out, strict=args.strict, limit=args.limit)
        print(json.dumps(summary, indent=2, default=str) if args.verbose else _ingest_line(summary, args.out))
        return 0
    if args.command == "stats":
        from memgas.pipeline.bank import Bank
        from memgas.pipeline.stats import compute_stats, format_stats

        stats = compute_stats(Bank(args.bank))
        print(json.dumps(stats, indent=2, default=str) if args.json else format_stats(stats))
        return 0
    if args.command == "synth":
        from memgas.pipeline.data.synth import synth

        path = synth(
            args.out, questions=args.questions, sessions_per_history=args.sessions, turns_per_session=args.turns,
            reuse_share=args.reuse, multi_session_share=args.multi_session, seed=args.seed,
        )
        print(f"wrote {path}")
        return 0
    if args.command == "report":
        from memgas.jobs.report import compare_runs, write_report

        if len(args.runs) == 1 and not args.out:
            print(f"wrote {write_report(args.runs[0])}")
        else:
            text = compare_runs(args.runs)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text)
                print(f"wrote {args.out}")
            else:
                print(text)
        return 0

    from memgas.pipeline.config import MemgasConfig

    cfg = MemgasConfig.load(getattr(args, "config", None), args.overrides)
    if args.address:
        cfg.ray.address = args.address
    if args.command == "serve":
        from memgas.pipeline.models.server import serve_forever_from_config

        serve_forever_from_config(cfg.llm, host=args.host, port=args.port)
        return 0
    from memgas.jobs import main_job

    use_ray = not args.no_ray
    if args.command == "index":
        main_job.index(cfg, args.bank, use_ray=use_ray)
        return 0
    if args.command == "answer":
        if args.method:
            cfg.retrieval.methods = args.method
        out = main_job.answer(cfg, args.bank, run_dir=args.out, use_ray=use_ray)
        print(f"report: {out}/report.md")
        return 0
    if args.command in ("run", "profile"):
        out = main_job.run(cfg, fresh=args.fresh, profile=args.command == "profile", use_ray=use_ray)
        if not args.quiet:
            from memgas.pipeline.bank import Bank
            from memgas.pipeline.stats import compute_stats, format_stats

            print(format_stats(compute_stats(Bank(cfg.bank_path))))
            print(_headline(out))
        print(f"report: {out}/report.md")
        return 0
    raise MemgasError(f"unknown command {args.command}")


def _headline(run_dir) -> str:
    """One line per method: Recall_all@5 and NDCG@10 (session level), from the run's metrics.json."""
    from pathlib import Path

    m = json.loads((Path(run_dir) / "metrics.json").read_text())
    lines = ["method                    R_all@5  NDCG@10   (session level, %)"]
    for method, r in m.get("retrieval", {}).get("session", {}).items():
        o = r.get("overall", {})
        lines.append(f"{method:25} {100 * (o.get('recall_all@5') or 0):7.1f}  {100 * (o.get('ndcg_any@10') or 0):7.1f}")
    return "\n".join(lines)


def _ingest_line(summary: dict, out: str) -> str:
    counts = summary.get("counts", summary)
    parts = ", ".join(f"{k}={v}" for k, v in counts.items() if isinstance(v, (int, float)))
    warn = summary.get("warnings") or {}
    n_warn = sum(v for v in warn.values() if isinstance(v, int)) if isinstance(warn, dict) else len(warn)
    return f"ingested into {out}: {parts}" + (f" ({n_warn} warnings; see the log)" if n_warn else "")

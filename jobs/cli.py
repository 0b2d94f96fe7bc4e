"""The `memgas` command line. Every subcommand has --help with examples; errors print one line.

Exit codes (docs/reliability.md): 0 success; 1 an internal error (a bug: one line, the traceback with
``-v``); 2 bad input (arguments, config, data, a missing or damaged bank); 3 the environment (disk full,
permission denied, read-only filesystem, an unreachable server); 4 the run finished but units failed
after retries (counted in the report); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM, handled like Ctrl-C).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
import textwrap
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from memgas import __version__
from memgas.pipeline.data import AUTO, FORMATS
from memgas.pipeline.data.synth import SYNTH_MAX_QUESTIONS, SYNTH_MAX_SESSIONS, SYNTH_MAX_TURNS
from memgas.pipeline.errors import MemgasError
from memgas.pipeline.redact import printable

log = logging.getLogger("memgas")

#: errno values that mean "the environment", not the input: exit 3
ENV_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EMFILE, errno.ENFILE,
    errno.ENOMEM, errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH,
    errno.ENETUNREACH, errno.ETIMEDOUT, errno.EBUSY, errno.ETXTBSY,
    errno.EFBIG,  # a file-size limit (`ulimit -f`, a filesystem's maximum): the environment, like a full disk
}
EXIT_BUG, EXIT_INPUT, EXIT_ENV, EXIT_INTERRUPTED = 1, 2, 3, 130
#: 128 + SIGTERM: what a shell reports for a process that SIGTERM ended (`timeout`, `docker stop`, Kubernetes)
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as a KeyboardInterrupt so that every path that cleans up after Ctrl-C (ingest's
    rollback, the runner's RUNNING.json, Ray's shutdown) cleans up after it the same way."""


#: set by the SIGTERM handler: the interrupt that reaches main() was a SIGTERM (ingest re-raises
#: its own KeyboardInterrupt subclass, so the exception's type alone cannot tell)
_terminated = False


def _on_sigterm(signum: int, frame: Any) -> None:
    global _terminated
    if _terminated:  # a second SIGTERM while cleaning up: let the cleanup finish (SIGKILL still ends it)
        return
    _terminated = True
    raise Terminated()


def install_sigterm_handler() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op in other threads, where Python
    cannot set handlers). ``ray.init`` replaces the handler with its own ``sys.exit``; the executor calls
    this again after it (jobs/executor.py)."""
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass


def _fmt(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``memgas ingest: error: ... (see memgas ingest --help)``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# -- argument types (argparse turns their ArgumentTypeError into a one-line usage error) ----------------
def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:,}, got {v:,}")
        return v

    parse.__name__ = f"int>={low}"
    return parse


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return v


def _port(text: str) -> int:
    v = _int_at_least(0)(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {v}")
    return v


# -- the parser: one small function per subcommand --------------------------------------------------------
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


def _sub(sub: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=_fmt(description),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    # -q/-v after the command too (`memgas ingest ... -q`); SUPPRESS keeps the top-level value otherwise
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="only warnings and errors")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="debug logging; tracebacks of internal errors")
    return p


def _add_ingest(sub: Any) -> None:
    p = _sub(sub, "ingest", "load a benchmark or JSONL file into a memory bank (Parquet)", """
        Load a dataset file into a memory bank directory (Parquet tables + manifest.json).
        Large LongMemEval-M files are streamed; memory stays bounded by one question.
        Re-ingesting replaces the bank's dataset only once the whole new file has been read: a bad
        file or an interrupt leaves the bank as it was; caches (generations, embeddings) are kept.

        Examples:
          memgas ingest ../shared/data/locomo/locomo10.json --format locomo --out banks/locomo
          memgas ingest longmemeval_s.json --format longmemeval --out banks/lme_s --limit 50
          memgas ingest my_histories.jsonl --out banks/mine --strict        # format detected
          memgas ingest new_sessions.jsonl --append --out banks/mine        # add sessions/histories

        --append adds to the bank instead of replacing it: a record whose history id is in the bank adds
        its new sessions after the existing ones (and its new questions); others add new histories. The
        same file appended twice changes nothing. A new session dated before its history's last session
        is refused unless --allow-reorder (then it goes into date order and the manifest records the
        position from which that history's association must be recomputed).
        """)
    p.add_argument("file", help="dataset file (.json or .jsonl)")
    p.add_argument("--format", "-f", default=AUTO, choices=[*FORMATS, AUTO],
                   help="dataset format (docs/data.md); default: detect from the file")
    p.add_argument("--out", "-o", required=True, help="bank directory to create or replace")
    p.add_argument("--strict", action="store_true",
                   help="turn data warnings (bad dates, dangling evidence, repeated sessions) into errors")
    p.add_argument("--limit", type=_int_at_least(0), help="only the first N histories/questions")
    p.add_argument("--append", action="store_true",
                   help="add the file's sessions, histories and questions to the bank at --out (which must exist)")
    p.add_argument("--allow-reorder", action="store_true",
                   help="with --append: accept sessions dated before a history's last one (inserted in date order)")


def _add_stats(sub: Any) -> None:
    p = _sub(sub, "stats", "describe a memory bank", """
        Histories, sessions, unique sessions (dedup ratio), turns, queries by type, evidence coverage
        and estimated tokens.

        Example:
          memgas stats banks/locomo --json
        """)
    p.add_argument("bank", help="bank directory")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_synth(sub: Any) -> None:
    p = _sub(sub, "synth", "write deterministic synthetic LongMemEval-format histories", """
        Seeded synthetic histories with planted facts and known evidence sessions, for scale tests.

        Examples:
          memgas synth synth_m.json --questions 500 --sessions 500          # LME-m sized
          memgas synth big.json --questions 1 --sessions 100000 --turns 4   # one huge history
        """)
    p.add_argument("out", help="output .json path")
    p.add_argument("--questions", type=_int_at_least(0, SYNTH_MAX_QUESTIONS), default=20, help="questions (= histories)")
    p.add_argument("--sessions", type=_int_at_least(1, SYNTH_MAX_SESSIONS), default=40, help="sessions per history")
    p.add_argument("--turns", type=_int_at_least(1, SYNTH_MAX_TURNS), default=6, help="utterances per session")
    p.add_argument("--reuse", type=_share, default=0.5, help="share of sessions drawn from a pool shared across histories")
    p.add_argument("--multi-session", type=_share, default=0.3,
                   help="share of questions whose fact is split over two sessions")
    p.add_argument("--seed", type=int, default=0)


def _add_index(sub: Any) -> None:
    p = _sub(sub, "index", "generate summaries/keywords, encode, and build association graphs", """
        unique sessions -> summary + keywords (LLM or LLM-free) -> embeddings -> GMM association per
        history -> Parquet. Cached by content hash: re-running computes only what is missing, and a
        killed run resumes without redoing finished units.

        Example:
          memgas index banks/locomo --config configs/locomo.yaml --set llm.backend=openai
        """)
    p.add_argument("bank", help="bank directory (from `memgas ingest`)")
    _add_config_args(p, positional=False)


def _add_answer(sub: Any) -> None:
    from memgas.pipeline.methods import KNOWN_METHOD_NAMES as ALL_METHODS

    p = _sub(sub, "answer", "rank sessions, read, answer and evaluate", """
        rank (entropy router + PPR, batched) -> filter -> answer -> evaluate -> report.
        --method replaces retrieval.methods; reading covers those of reading.methods among them.

        Example:
          memgas answer banks/locomo --config configs/locomo.yaml --method memgas --method session --out runs/x
        """)
    p.add_argument("bank", help="indexed bank directory")
    _add_config_args(p, positional=False)
    p.add_argument("--method", action="append", choices=ALL_METHODS, metavar="METHOD",
                   help=f"retrieval method (repeatable; default: config's list); one of {', '.join(ALL_METHODS)}")
    p.add_argument("--out", help="run directory for metrics and the report (default: config output_dir)")


def _add_run_like(sub: Any, name: str, helptext: str) -> None:
    p = _sub(sub, name, helptext, f"""
        {helptext}.
        Writes into the config's output_dir: bank/, metrics.json, report.md, *.png, manifest.json.

        Examples:
          memgas {name} configs/demo.yaml
          memgas {name} configs/locomo.yaml --set reading.max_questions=50
          RAY_ADDRESS=auto memgas {name} configs/cluster.yaml
        """)
    _add_config_args(p, positional=True)
    p.add_argument("--fresh", action="store_true",
                   help="first remove what memgas wrote in output_dir (its own files only; never yours)")


def _add_report(sub: Any) -> None:
    p = _sub(sub, "report", "write or compare reports of finished runs", """
        With one run directory: (re)write its report.md and plots from metrics.json. With several (or
        --out): a side-by-side comparison, which says so when the runs used different datasets.

        Example:
          memgas report runs/locomo_minilm runs/locomo_contriever --out cmp.md
        """)
    p.add_argument("runs", nargs="+", help="run directories holding metrics.json")
    p.add_argument("--out", help="comparison markdown path (default: print)")


def _add_serve(sub: Any) -> None:
    p = _sub(sub, "serve", "serve the configured LLM as an OpenAI-compatible HTTP endpoint", """
        POST /v1/chat/completions, GET /v1/models, GET /health; one request at a time reaches the
        model (for tests, demos and sharing one CPU model; use `vllm serve` for throughput).
        Completions are answered whole: `stream: true` is refused (400), as are invalid parameters.

        Example:
          memgas serve --port 8011   # then llm.backend=openai, llm.base_url=http://127.0.0.1:8011/v1
        """)
    _add_config_args(p, positional=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8011, help="TCP port (0: any free port; the URL is logged)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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

            Exit codes: 0 ok, 1 internal error (re-run with -v), 2 bad input, 3 environment
            (disk full, permissions, unreachable), 4 finished but units failed after retries
            (counted in the report; re-run to retry them), 130 interrupted, 143 terminated (SIGTERM).
            """
        ),
    )
    parser.add_argument("--version", action="version", version=f"memgas {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks of internal errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_ingest(sub)
    _add_stats(sub)
    _add_synth(sub)
    _add_index(sub)
    _add_answer(sub)
    _add_run_like(sub, "run", "the main job: ingest + index + answer + evaluate + report")
    _add_run_like(sub, "profile", "the main job with per-stage throughput, latency p50/p95 and a profile report")
    _add_report(sub)
    _add_serve(sub)
    return parser


class _SafeFormatter(logging.Formatter):
    """Log lines (warnings included) as :func:`printable` makes them: no credentials, no control sequences
    from data (a question type holding ``ESC ] 52 ;...`` would otherwise write the user's clipboard)."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def _setup_logging(args: argparse.Namespace) -> None:
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    fmt, datefmt = "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt)
    for handler in logging.getLogger().handlers:
        if type(handler.formatter) is logging.Formatter:  # the one basicConfig made (now or by an earlier main())
            handler.setFormatter(_SafeFormatter(fmt, datefmt))
    for noisy in ("httpx", "urllib3", "filelock", "sentence_transformers", "transformers"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"


# -- errors -------------------------------------------------------------------------------------------------
def _os_error(exc: OSError) -> tuple[int, str]:
    """(exit code, one line) for an OSError: 3 when the environment is at fault, else 2."""
    code = EXIT_ENV if exc.errno in ENV_ERRNOS or isinstance(exc, (ConnectionError, TimeoutError)) else EXIT_INPUT
    what = exc.strerror or str(exc) or type(exc).__name__
    names = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
    line = what + (f": {' -> '.join(names)}" if names else "")
    hints = {
        errno.ENOSPC: "free some space and re-run; completed work is kept",
        errno.EDQUOT: "free some space and re-run; completed work is kept",
        errno.EROFS: "choose a writable location",
        errno.EADDRINUSE: "choose another --port",
        errno.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere; completed work is kept",
    }
    if exc.errno in hints:
        line += f" ({hints[exc.errno]})"
    return code, line


def _unreachable(exc: BaseException) -> bool:
    """Network failures of HTTP clients that are not OSErrors (httpx)."""
    mod = type(exc).__module__ or ""
    return mod.startswith(("httpx", "httpcore")) and any(w in type(exc).__name__ for w in ("Connect", "Timeout", "Network"))


def _one_line(text: Any) -> str:
    """One printable line: whitespace collapsed, credentials redacted, control characters shown as ``\\xNN``."""
    return printable(" ".join(str(text).split())) or "(no message)"


def _show(text: str) -> None:
    """Print text that may hold dataset strings (question types, paths, ids) to stdout, made printable."""
    print(printable(text))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    _setup_logging(args)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    prefix = f"memgas {args.command}: error:"
    global _terminated
    _terminated = False
    previous = signal.getsignal(signal.SIGTERM)
    install_sigterm_handler()
    try:
        return _dispatch(args)
    except MemgasError as exc:
        print(f"{prefix} {_one_line(exc)}", file=sys.stderr)
        # IncompleteRun (units failed after retries) exits 4, EnvironmentFailure 3, bad input 2
        return int(getattr(exc, "exit_code", EXIT_INPUT))
    except BrokenPipeError:  # `memgas stats BANK | head`
        _silence_stdout()
        return 0
    except KeyboardInterrupt as exc:
        if _terminated:
            print(f"memgas {args.command}: terminated (SIGTERM): {_one_line(_interrupted(args.command, exc))}",
                  file=sys.stderr)
            return EXIT_TERMINATED
        print(f"memgas {args.command}: {_one_line(_interrupted(args.command, exc))}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        code, line = _os_error(exc)
        if args.verbose:
            traceback.print_exc()
        print(f"{prefix} {_one_line(line)}", file=sys.stderr)
        return code
    except MemoryError:
        print(f"{prefix} out of memory", file=sys.stderr)
        return EXIT_ENV
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, the traceback only with -v
        if _unreachable(exc):
            print(f"{prefix} {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
            return EXIT_ENV
        if args.verbose:
            traceback.print_exc()  # -v: the user asked for the raw traceback
        print(f"{prefix} internal error {type(exc).__name__}: {_one_line(exc)} (a bug; re-run with -v for the "
              "traceback)", file=sys.stderr)
        return EXIT_BUG
    finally:
        if threading.current_thread() is threading.main_thread() and previous is not None:
            signal.signal(signal.SIGTERM, previous)  # in-process callers (tests) get their own handler back


def _interrupted(command: str, exc: KeyboardInterrupt) -> str:
    message = getattr(exc, "message", None)
    if message:
        return message
    if command in ("run", "profile", "index", "answer"):
        return "interrupted; completed units are kept, re-run to resume"
    return "interrupted"


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so that the interpreter's final flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


# -- dispatch: one function per command -----------------------------------------------------------------------
def _dispatch(args: argparse.Namespace) -> int:
    handler = {
        "ingest": _cmd_ingest, "stats": _cmd_stats, "synth": _cmd_synth, "report": _cmd_report,
        "serve": _cmd_serve, "index": _cmd_index, "answer": _cmd_answer, "run": _cmd_run, "profile": _cmd_run,
    }.get(args.command)
    if handler is None:
        raise MemgasError(f"unknown command {args.command}")
    return handler(args)


def _cmd_ingest(args: argparse.Namespace) -> int:
    from memgas.pipeline.ingest import append, ingest

    if args.allow_reorder and not args.append:
        raise MemgasError("--allow-reorder goes with --append")
    if args.append:
        if args.limit is not None:
            raise MemgasError("--limit does not go with --append (an append takes the whole file)")
        summary = append(args.file, args.format, args.out, strict=args.strict, allow_reorder=args.allow_reorder,
                         progress=not args.quiet)
        if not summary["committed"]:
            _show(f"nothing to append to {args.out}: every session and question of {args.file} is there already")
        else:
            _show(json.dumps(summary, indent=2, default=str) if args.verbose else
                  _ingest_line(summary, args.out).replace("ingested into", "appended to", 1))
        return 0
    summary = ingest(args.file, args.format, args.out, strict=args.strict, limit=args.limit, progress=not args.quiet)
    _show(json.dumps(summary, indent=2, default=str) if args.verbose else _ingest_line(summary, args.out))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.stats import compute_stats, format_stats

    stats = compute_stats(Bank(args.bank))
    _show(json.dumps(stats, indent=2, default=str) if args.json else format_stats(stats))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from memgas.pipeline.data.synth import synth

    path = synth(
        args.out, questions=args.questions, sessions_per_history=args.sessions, turns_per_session=args.turns,
        reuse_share=args.reuse, multi_session_share=args.multi_session, seed=args.seed,
    )
    print(f"wrote {path}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from memgas.jobs.report import compare_runs, write_comparison, write_report

    if len(args.runs) == 1 and not args.out:
        _show(f"wrote {write_report(args.runs[0])}")
        return 0
    text = compare_runs(args.runs)
    if args.out:
        write_comparison(args.out, text)
        _show(f"wrote {args.out}")
    else:
        _show(text)
    return 0


def _load_config(args: argparse.Namespace):
    from memgas.pipeline.config import MemgasConfig

    cfg = MemgasConfig.load(getattr(args, "config", None), args.overrides)
    if args.address:
        cfg.ray.address = args.address
    return cfg


def _cmd_serve(args: argparse.Namespace) -> int:
    from memgas.pipeline.models.server import serve_forever_from_config

    cfg = _load_config(args)
    serve_forever_from_config(cfg.llm, host=args.host, port=args.port, seed=cfg.seed)
    return 0


def _open_bank(path: str):
    from memgas.pipeline.bank import Bank

    return Bank(path)  # a missing or foreign directory: one-line BankError before any model loads


def _cmd_index(args: argparse.Namespace) -> int:
    from memgas.jobs import main_job

    cfg = _load_config(args)
    _open_bank(args.bank)
    main_job.index(cfg, args.bank, use_ray=not args.no_ray)
    return 0


def _cmd_answer(args: argparse.Namespace) -> int:
    from memgas.jobs import main_job

    cfg = _load_config(args)
    if args.method:
        cfg = _with_methods(cfg, args.method)
    _open_bank(args.bank)
    if args.out:
        from memgas.pipeline.config import check_writable_dir

        check_writable_dir("--out", Path(args.out))
    else:
        cfg.check_paths(data=False)
    out = main_job.answer(cfg, args.bank, run_dir=args.out, use_ray=not args.no_ray)
    _show(f"report: {out}/report.md")
    return 0


def _with_methods(cfg, methods: list[str]):
    """``--method``: the retrieval methods; reading keeps those of its methods that are among them."""
    methods = list(dict.fromkeys(methods))
    reading = [m for m in cfg.reading.methods if m in methods]
    if cfg.reading.enabled and not reading:
        log.info("reading skipped: reading.methods %s are not among --method %s", cfg.reading.methods, methods)
    data = cfg.model_dump()
    data["retrieval"]["methods"] = methods
    data["reading"]["methods"] = reading
    return type(cfg).model_validate(data)


def _cmd_run(args: argparse.Namespace) -> int:
    from memgas.jobs import main_job

    cfg = _load_config(args)
    cfg.check_paths()
    out = main_job.run(cfg, fresh=args.fresh, profile=args.command == "profile", use_ray=not args.no_ray)
    if not args.quiet:
        from memgas.pipeline.bank import Bank
        from memgas.pipeline.stats import compute_stats, format_stats

        _show(format_stats(compute_stats(Bank(cfg.bank_path))))
        _show(_headline(out))
    _show(f"report: {out}/report.md")
    return 0


def _headline(run_dir) -> str:
    """One line per method: Recall_all@5 and NDCG@10 (session level), from the run's metrics.json."""
    try:
        m = json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return "(no metrics.json to summarise)"
    lines = ["method                    R_all@5  NDCG@10   (session level, %)"]
    for method, r in ((m.get("retrieval") or {}).get("session") or {}).items():
        o = (r or {}).get("overall") or {}
        lines.append(f"{method:25} {_pct(o.get('recall_all@5'))}  {_pct(o.get('ndcg_any@10'))}")
    return "\n".join(lines)


def _pct(v: Any) -> str:
    return f"{100 * v:7.1f}" if isinstance(v, (int, float)) else f"{'-':>7}"


def _ingest_line(summary: dict, out: str) -> str:
    counts = summary.get("counts", summary)
    parts = ", ".join(f"{k}={v}" for k, v in counts.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    n_warn = summary.get("warning_count")
    if n_warn is None:  # older summaries: {kind: {count, examples}}
        warn = summary.get("warnings") or {}
        n_warn = sum(int(v.get("count", 0)) if isinstance(v, dict) else int(v) for v in warn.values())
    kinds = ", ".join(f"{k} {v.get('count', 0)}" for k, v in (summary.get("warnings") or {}).items() if isinstance(v, dict))
    notes = ", ".join(f"{k} {v.get('histories', v.get('count', 0))}" for k, v in (summary.get("notes") or {}).items()
                      if isinstance(v, dict))
    fmt = f" ({summary['format']})" if summary.get("format") else ""
    return (f"ingested into {out}{fmt}: {parts}; {n_warn} warnings" + (f" ({kinds}; see the log)" if n_warn else "")
            + (f"; notes: {notes} histories" if notes else ""))

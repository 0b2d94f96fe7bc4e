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
import threading
import traceback
from pathlib import Path
from typing import Any

from memgas.jobs.cli_args import EXIT_BUG, EXIT_ENV, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED
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
    if not args.verbose:  # model-loading bars of in-process models (--no-ray, serve); workers: QUIET_WORKER_ENV
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


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
    from memgas.jobs.cli_args import (
        build_parser,  # imported here: it imports this module's exit codes
    )

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
    if args.replace and args.append:  # one adds to the bank's dataset, the other starts it over
        raise MemgasError("--replace does not go with --append: --append adds the file to the bank, --replace "
                          "starts the bank over with it")
    if args.append:
        if args.limit is not None:
            raise MemgasError("--limit does not go with --append (an append takes the whole file)")
        summary = append(args.file, args.format, args.out, strict=args.strict, allow_reorder=args.allow_reorder,
                         progress=not args.quiet)
        if not summary["committed"]:
            if not summary["records"]:
                _show(f"nothing appended to {args.out}: {args.file} holds no history record")
            elif summary.get("warning_count"):  # skipped with a warning (no turns, ...), not found in the bank
                kinds = ", ".join(f"{k} {v.get('count', 0)}" for k, v in (summary.get("warnings") or {}).items()
                                  if isinstance(v, dict))
                _show(f"nothing to append to {args.out}: {args.file} adds no new session or question "
                      f"({summary['warning_count']} warnings ({kinds}); see the log)")
            else:
                _show(f"nothing to append to {args.out}: every session and question of {args.file} is there already")
        else:
            _show(json.dumps(summary, indent=2, default=str) if args.verbose else
                  _ingest_line(summary, args.out).replace("ingested into", "appended to", 1))
        return 0
    if not args.replace:
        _refuse_to_replace_appends(args.out, args.file)
    summary = ingest(args.file, args.format, args.out, strict=args.strict, limit=args.limit, progress=not args.quiet,
                     replace=args.replace)
    _show(json.dumps(summary, indent=2, default=str) if args.verbose else _ingest_line(summary, args.out))
    return 0


def _refuse_to_replace_appends(out: str, file: str) -> None:
    """A plain ingest replaces the bank's dataset; on a bank grown by ``--append`` that would drop what the
    appends added, which the user never asked for in this command: refuse, naming both ways on."""
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.ingest import APPEND_KIND

    try:
        datasets = Bank(out).manifest.get("datasets") or [] if Path(out, "manifest.json").exists() else []
    except (MemgasError, OSError, ValueError):  # not a bank, or a damaged one: replacing it loses nothing usable
        return
    appends = [d.get("path") or "?" for d in datasets if d.get("kind") == APPEND_KIND]
    if appends:
        raise MemgasError(f"{out} was grown by {len(appends)} append(s) ({', '.join(map(str, appends))}); a plain "
                          f"ingest would replace them with {file}: add it with --append, or start the bank over "
                          "with --replace")


def _cmd_stats(args: argparse.Namespace) -> int:
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.stats import compute_stats, format_stats

    stats = compute_stats(Bank(args.bank))
    _show(json.dumps(stats, indent=2, default=str) if args.json else format_stats(stats))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from memgas.pipeline.data.synth import CLI_DEFAULTS, SHAPES, synth

    given = dict(questions=args.questions, sessions_per_history=args.sessions, turns_per_session=args.turns,
                 reuse_share=args.reuse, multi_session_share=args.multi_session, pool_size=args.pool)
    kw = {**CLI_DEFAULTS, **SHAPES.get(args.shape or "", {}), **{k: v for k, v in given.items() if v is not None}}
    path = synth(args.out, seed=args.seed, **kw)
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

    from memgas.jobs.preflight import check

    cfg = _load_config(args)
    check(cfg, "serve", use_ray=False)  # the LLM's backend, device and package, before the socket or the model
    serve_forever_from_config(cfg.llm, host=args.host, port=args.port, seed=cfg.seed, max_queue=args.max_queue)
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
    lines = ["method                    R_all@5  NDCG@10   (session level, %"
             + ("; meaningless: synthetic encoder)" if m.get("synthetic_encoder") else ")")]
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

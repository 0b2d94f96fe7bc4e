"""The `memgas` command line's parser: one small function per subcommand, their argument types, a parser
whose usage errors are one line with exit 2 (bad input), and the exit codes (:mod:`memgas.jobs.cli` maps
errors to them)."""

from __future__ import annotations

import argparse
import signal
import textwrap
from typing import Any, NoReturn

from memgas.pipeline.data import AUTO, FORMATS
from memgas.pipeline.models.model_queue import MAX_QUEUE
from memgas.pipeline.data.synth import (
    SHAPES,
    SYNTH_MAX_POOL,
    SYNTH_MAX_QUESTIONS,
    SYNTH_MAX_SESSIONS,
    SYNTH_MAX_TURNS,
)

from memgas import __version__
from memgas.pipeline.errors import EXIT_BUG  # noqa: F401  (re-exported beside the other exit codes)


#: the command line's exit codes (a bug's, 1, is ``pipeline.errors.EXIT_BUG``: the errors' own home)
EXIT_INPUT, EXIT_ENV, EXIT_INTERRUPTED = 2, 3, 130
#: 128 + SIGTERM: what a shell reports for a process that SIGTERM ended (`timeout`, `docker stop`, Kubernetes)
EXIT_TERMINATED = 128 + signal.SIGTERM


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

        A bank grown by --append is not replaced by a plain ingest (its appends would be lost) unless
        --replace says so.
        """)
    p.add_argument("file", help="dataset file (.json or .jsonl)")
    p.add_argument("--format", "-f", default=AUTO, choices=[*FORMATS, AUTO],
                   help="dataset format (docs/data.md); default: detect from the file")
    p.add_argument("--out", "-o", required=True, help="bank directory to create or replace")
    p.add_argument("--strict", action="store_true",
                   help="turn data warnings (bad dates, dangling evidence, repeated sessions) into errors")
    p.add_argument("--limit", type=_int_at_least(0), help="only the first N histories/questions")
    p.add_argument("--replace", action="store_true",
                   help="replace a bank grown by --append with this file (its appends are dropped)")
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
          memgas synth synth_m.json --shape m                             # LongMemEval-M's shape
          memgas synth m100.json --shape m --questions 100                 # its first 100 questions
          memgas synth big.json --questions 1 --sessions 100000 --turns 4   # one huge history
        """)
    p.add_argument("out", help="output .json path")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a published split's shape (m: LongMemEval-M, docs/data.md); "
                   "the options below override its values")
    p.add_argument("--questions", type=_int_at_least(0, SYNTH_MAX_QUESTIONS), help="questions (= histories; default 20)")
    p.add_argument("--sessions", type=_int_at_least(1, SYNTH_MAX_SESSIONS), help="sessions per history (default 40)")
    p.add_argument("--turns", type=_int_at_least(1, SYNTH_MAX_TURNS), help="utterances per session (default 6)")
    p.add_argument("--reuse", type=_share, help="share of sessions drawn from a pool shared across histories (default 0.5)")
    p.add_argument("--pool", type=_int_at_least(1, SYNTH_MAX_POOL),
                   help="sessions in the shared pool (default four histories' worth)")
    p.add_argument("--multi-session", type=_share,
                   help="share of questions whose fact is split over two sessions (default 0.3)")
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
        model (for tests, demos and sharing one CPU model; use `vllm serve` for throughput), at most
        --max-queue wait for it, and a request whose client hangs up stops. SIGTERM exits 0.
        Completions are answered whole: `stream: true` is refused (400), as are invalid parameters.

        Example:
          memgas serve --port 8011   # then llm.backend=openai, llm.base_url=http://127.0.0.1:8011/v1
        """)
    _add_config_args(p, positional=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8011, help="TCP port (0: any free port; the URL is logged)")
    p.add_argument("--max-queue", type=_int_at_least(0), default=MAX_QUEUE, metavar="N",
                   help="requests that may wait for the model behind the one it runs; past it a request is "
                        "answered 503 with Retry-After (default: %(default)s)")


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

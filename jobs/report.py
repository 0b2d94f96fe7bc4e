"""Reports of a run: ``report.md`` tables for people and PNG plots, from ``metrics.json``.

metrics.json layout (written by :mod:`memgas.jobs.main_job`, the commands)::

    {"run": {...}, "dataset": {...},
     "retrieval": {"session": {METHOD: {"overall": {metric: value}, "by_type": {type: {metric: value}},
                                        "n_evaluated": int, "skipped": {reason: int}}},
                   "turn": {...same, optional...}},
     "qa": {METHOD: {"overall": {...}, "by_type": {...}, "n": int, "notes": [...]}},
     "stages": {STAGE: {wall_s, cpu_s, peak_rss_mb, items, items_per_s, tokens_per_s, ...}},
     "latency": {"ranking": {p50_ms, p95_ms, ...}, "reading": {...}}}
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from memgas.jobs.plot_styles import method_styles
from memgas.pipeline.errors import MemgasError
from memgas.pipeline.models.synthetic import SYNTHETIC_NOTE

log = logging.getLogger(__name__)

HEADLINE_KS = (1, 3, 5, 10)


def _num(v: Any) -> float | None:
    """A finite number, or None (missing, null, NaN: e.g. a metric over 0 evaluated questions)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _fmt(v: Any, scale: float = 100.0) -> str:
    x = _num(v)
    return "–" if x is None else f"{x * scale:.1f}"


def _n(v: Any) -> str:
    x = _num(v)
    return "?" if x is None else str(int(x))


def _d(v: Any) -> dict[str, Any]:
    """``v`` if it is a dict, else an empty one (sections of a metrics.json written by another version)."""
    return v if isinstance(v, dict) else {}


def _f(v: Any, spec: str) -> str:
    x = _num(v)
    return format(x if x is not None else 0.0, spec)


_MD_SPECIAL = {"\\": "\\\\", "|": "\\|", "`": "\\`", "*": "\\*", "[": "\\[", "]": "\\]", "<": "&lt;",
               ">": "&gt;", "&": "&amp;"}


def md_escape(value: Any) -> str:
    """``value`` as inert Markdown text for one table cell or line: dataset strings (question types, paths,
    names) may hold ``|`` (a new column), newlines (a new row or block), HTML (``<script>``, ``<img>``) or
    link syntax; control characters become spaces. Our own numbers and dashes pass through unchanged."""
    text = "".join(" " if ord(ch) < 32 or 0x7F <= ord(ch) <= 0x9F else _MD_SPECIAL.get(ch, ch) for ch in str(value))
    return text


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; every cell escaped (:func:`md_escape`), whatever its source."""
    header = [md_escape(h) for h in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(md_escape(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


#: The reader's-context columns (``retrieval.session[method].reader``, jobs/evaluate_run.py: reader_evidence):
#: (header, key, scale of the number shown)
READER_COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("evidence in context", "evidence_recall", 100.0), ("all evidence in context", "evidence_all", 100.0),
    ("verbatim evidence", "evidence_verbatim", 100.0), ("context tokens", "context_tokens", 1.0))


def retrieval_table(level: dict[str, Any], ks: tuple[int, ...] = HEADLINE_KS) -> str:
    header = ["method"] + [f"R_all@{k}" for k in ks] + [f"R_any@{k}" for k in ks] + [f"NDCG@{k}" for k in ks]
    reader = any(_d(_d(m).get("reader")) for m in level.values())
    if reader:
        header += [h for h, _, _ in READER_COLUMNS]
    rows = []
    for method, m in level.items():
        o = _d(_d(m).get("overall"))
        r = _d(_d(_d(m).get("reader")).get("overall"))
        rows.append(
            [method]
            + [_fmt(o.get(f"recall_all@{k}")) for k in ks]
            + [_fmt(o.get(f"recall_any@{k}")) for k in ks]
            + [_fmt(o.get(f"ndcg_any@{k}")) for k in ks]
            + ([_fmt(r.get(key), scale) for _, key, scale in READER_COLUMNS] if reader else [])
        )
    return _md_table(header, rows)


def by_type_table(level: dict[str, Any], metric: str = "recall_all@5") -> str:
    types = sorted({t for m in level.values() for t in _d(_d(m).get("by_type"))})
    rows = [[method] + [_fmt(_d(_d(_d(m).get("by_type")).get(t)).get(metric)) for t in types] for method, m in level.items()]
    return _md_table(["method"] + [f"{t} (n={_type_n(level, t)})" for t in types], rows)


def _type_n(level: dict[str, Any], t: str) -> Any:
    for m in level.values():
        n = _num(_d(_d(_d(m).get("by_type")).get(t)).get("n"))
        if n is not None:
            return int(n)
    return "?"


def qa_table(qa: dict[str, Any]) -> str:
    metrics = ["f1", "exact_match", "bleu4", "rouge1", "rouge2", "rougeL", "judge_accuracy", "bertscore_f1"]
    present = [k for k in metrics if any(k in _d(_d(m).get("overall")) for m in qa.values())]
    rows = [[method, _n(_d(m).get("n")), _n(_d(m).get("failed", 0))] + [_fmt(_d(_d(m).get("overall")).get(k)) for k in present]
            for method, m in qa.items()]
    return _md_table(["method", "n scored", "failed (not scored)"] + present, rows)


def encoding_table(encoding: dict[str, Any]) -> str:
    """Texts, truncation and tokens per granularity (``pipeline.encode.encoding_accounting``)."""
    rows = []
    for g, v in encoding.items():
        v = _d(v)
        tok, drop = _num(v.get("tokens")), _num(v.get("tokens_dropped"))
        share = f"{100 * drop / (tok + drop):.1f}%" if tok is not None and drop is not None and tok + drop else "-"
        rows.append([g, _n(v.get("texts")), _n(v.get("truncated")), _n(v.get("tokens")), _n(v.get("tokens_dropped")),
                     share])
    return _md_table(["granularity", "texts", "truncated", "tokens encoded", "tokens dropped", "share dropped"], rows)


def tokens_table(tokens: dict[str, Any]) -> str:
    """Prompt + completion tokens per method and step (``evaluate_run.method_tokens``)."""
    rows = []
    for m, v in tokens.items():
        steps = [_d(_d(v).get(k)) for k in ("construction", "planner", "answer")]
        rows.append([m, *[f"{_n(s.get('prompt'))} + {_n(s.get('completion'))}" for s in steps]])
    return _md_table(["method", "construction (prompt + completion)", "planner", "answer"], rows)


def _count(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word.replace('history', 'historie')}s"


def ranked_lines(record: list[dict[str, Any]]) -> list[str]:
    """What each ranker ranked and kept (after an append only the changed histories are ranked)."""
    lines = [f"- {r['stage']}: ranked {_count(r['questions_ranked'], 'question')} of "
             f"{_count(r['histories_ranked'], 'history')}; kept {_count(r['questions_kept'], 'question')} of "
             f"{_count(r['histories_kept'], 'unchanged history')} ranked by an earlier answer"
             for r in record if isinstance(r.get("histories_ranked"), int)]
    return ["", *lines] if lines else []


def stage_table(stages: dict[str, Any]) -> str:
    rows = []
    for name, s in stages.items():
        s = _d(s)
        rows.append(
            [
                name,
                _f(s.get("wall_s"), ".1f"),
                _f(s.get("cpu_s"), ".1f"),
                _f(s.get("peak_rss_mb"), ".0f"),
                str(s.get("items", 0)),
                _f(s.get("items_per_s"), ".1f"),
                _f(s.get("tokens_per_s"), ".0f"),
                str(s.get("skipped", 0)),
            ]
        )
    return _md_table(["stage", "wall s", "cpu s", "peak RSS MB", "items", "items/s", "tokens/s", "cached/skipped"], rows)


def justmem_llm_table(stages: dict[str, Any]) -> str | None:
    """Per JustMem stage that called an LLM: items stored, LLM-free fallbacks (outputs still invalid after the
    repair) and backend failures (nothing stored, retried by the next run). None when neither called one."""
    rows = []
    for name, what in (("cards", "sessions"), ("plan", "rows")):
        x = _d(_d(stages.get(name)).get("extra"))
        s = _d(stages.get(name))
        if not (_num(s.get("prompt_tokens")) or _num(x.get("fallbacks")) or _num(x.get("llm_failures"))):
            continue
        rows.append([name, _n(x.get(what)), _n(x.get("fallbacks", 0)), _n(x.get("llm_failures", 0))])
    if not rows:
        return None
    return _md_table(["stage", "items stored", "LLM-free fallbacks", "failed (retried next run)"], rows)


def _pct_or_nan(v: Any) -> float:
    x = _num(v)
    return float("nan") if x is None else 100 * x


#: the PNGs :func:`plot_run` may write into a run directory (jobs/run_dir.py's RUN_FILES lists them too)
PLOT_FILES: tuple[str, ...] = ("recall_at_k.png", "recall_by_type.png", "stage_times.png")


def plot_run(metrics: dict[str, Any], out_dir: Path) -> list[Path]:
    """Recall@K curves per method, per-type bars, and the stage time breakdown.

    A plot without a single finite value (a dataset without retrieval ground truth, such as
    Long-MT-Bench+, or with no histories) is left out instead of drawn empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    level = {k: _d(v) for k, v in _d(_d(metrics.get("retrieval")).get("session")).items()}
    ks = sorted({int(k.split("@")[1]) for m in level.values() for k in _d(m.get("overall"))
                 if k.startswith("recall_all@") and k.split("@")[1].isdigit()})
    curves = {method: [_pct_or_nan(_d(m.get("overall")).get(f"recall_all@{k}")) for k in ks] for method, m in level.items()}
    if ks and any(math.isfinite(v) for c in curves.values() for v in c):
        styles = method_styles(list(curves))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for method, ys in curves.items():
            ax.plot(ks, ys, label=method, markersize=5, linewidth=1.4, **styles[method])
        if min(ks) > 0:
            ax.set_xscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K (sessions retrieved)")
        ax.set_ylabel("Recall_all@K (%)")
        ax.set_title("Session-level recall by method")
        ax.grid(alpha=0.3)
        # beside the plot: 15 entries inside it would hide the curves
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        written.append(out_dir / PLOT_FILES[0])
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    types = sorted({t for m in level.values() for t in _d(m.get("by_type"))})
    bars = {method: [_pct_or_nan(_d(_d(m.get("by_type")).get(t)).get("recall_all@5")) for t in types]
            for method, m in level.items()}
    if types and any(math.isfinite(v) for b in bars.values() for v in b):
        import numpy as np

        fig, ax = plt.subplots(figsize=(max(9, 1.4 * len(types) + 2), 4.5))
        width = 0.8 / max(1, len(level))
        x = np.arange(len(types))
        colours = {m: st["color"] for m, st in method_styles(list(bars)).items()}
        for i, (method, vals) in enumerate(bars.items()):
            ax.bar(x + i * width, vals, width, label=method, color=colours[method])
        # data strings: control characters would reach the terminal in matplotlib's missing-glyph warnings
        labels = ["".join(" " if ord(c) < 32 or 0x7F <= ord(c) <= 0x9F else c for c in t) for t in types]
        ax.set_xticks(x + 0.4 - width / 2, labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("Recall_all@5 (%)")
        ax.set_title("Recall_all@5 by question type")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        written.append(out_dir / PLOT_FILES[1])
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    stages = _d(metrics.get("stages"))
    if stages:
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(stages) + 1.5))
        names = list(stages)
        ax.barh(names, [_num(_d(stages[n]).get("wall_s")) or 0.0 for n in names], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("wall time (s)")
        ax.set_title("Stage time breakdown")
        fig.tight_layout()
        written.append(out_dir / PLOT_FILES[2])
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def _association(a: dict[str, Any]) -> str | None:
    """The candidate search, and under IVF what it costs: recall@k against the exact search."""
    if not a.get("search"):
        return None
    if a["search"] != "ivf":
        return str(a["search"])
    text = (f"ivf (nlist {a.get('ivf_nlist')}, nprobe {a.get('ivf_nprobe')}; the first {a.get('ivf_exact_nodes')} "
            "nodes of a history searched exactly)")
    if a.get("ivf_recall") is None:
        return text + "; no history past the exact prefix, so every row was searched exactly"
    return (text + f"; candidate recall@{a.get('ivf_recall_k')} against the exact search "
            f"{_f(a.get('ivf_recall'), '.4f')} on {a.get('ivf_recall_rows')} sampled rows of "
            f"{a.get('ivf_recall_histories')} histories (lowest history {_f(a.get('ivf_recall_min_history'), '.4f')})")


def render_markdown(metrics: dict[str, Any], plots: list[Path] | None = None, plots_off: bool = False) -> str:
    run = _d(metrics.get("run"))
    dataset = _d(metrics.get("dataset"))
    parts = [f"# memgas report: {md_escape(run.get('name', '?'))}", ""]
    # a synthetic encoder's run (vectors from hashes): its retrieval and QA numbers measure nothing
    meaningless = ": meaningless (synthetic encoder)" if metrics.get("synthetic_encoder") else ""
    if meaningless:
        parts += [f"**{md_escape(_d(metrics.get('notes')).get('synthetic_encoder') or SYNTHETIC_NOTE)}.**", ""]
    info = [
        ("dataset", dataset.get("path")),
        # a grown bank: the files appended to it, in order; its sha256 is that of its whole ingest history
        ("appended", ", ".join(Path(str(_d(x).get("path"))).name for x in dataset["appends"])
         if isinstance(dataset.get("appends"), list) and dataset["appends"] else None),
        ("dataset sha256", dataset.get("sha256")),
        ("encoder", run.get("encoder")),
        ("generator", run.get("generator")),
        ("reader LLM", run.get("llm")),
        ("router", run.get("router")),
        ("code", f"memgas {run.get('version', '?')} ({run.get('git_commit', '?')})"),
        ("wall time", f"{_f(run.get('wall_s'), '.1f')} s"),
        ("no-GMM ablation", f"top-{run['topk_edges']} edges per node" if run.get("topk_edges") is not None else None),
        ("association search", _association(_d(run.get("association")))),
    ]
    parts += [f"- **{k}**: {md_escape(v)}" for k, v in info if v is not None]
    for level_name, level in _d(metrics.get("retrieval")).items():
        level = {k: _d(v) for k, v in _d(level).items()}
        if not level:
            continue
        any_m = next(iter(level.values()))
        parts += [
            "",
            f"## Retrieval ({md_escape(level_name)} level){meaningless}",
            "",
            f"{md_escape(any_m.get('n_evaluated', '?'))} questions evaluated; skipped: "
            f"{md_escape(any_m.get('skipped', {}))}. "
            "R_all = all evidence sessions in the top K (the paper's Recall@K); NDCG = LongMemEval's ndcg_any."
            + (f" Note: {md_escape(_d(metrics.get('notes')).get('turn_level'))}." if level_name == "turn"
               and _d(metrics.get("notes")).get("turn_level") else "")
            + (" Evidence in context = the share of evidence utterances in the reader's context (all: every one "
               "of them; verbatim: in their own words), context tokens = its mean tokens per question; "
               f"{md_escape(_d(metrics.get('notes')).get('reader_evidence'))}."
               if level_name == "session" and _d(metrics.get("notes")).get("reader_evidence") else "")
            + (f" The evidence in context leaves out {md_escape(unmeasured)} questions ingested before the bank "
               "kept evidence turns (re-ingest to measure them)."
               if level_name == "session" and (unmeasured := _d(_d(any_m).get("reader")).get("not_measured")) else ""),
            "",
            retrieval_table(level),
            "",
            "### Recall_all@5 by question type",
            "",
            by_type_table(level),
        ]
    qa = {k: _d(v) for k, v in _d(metrics.get("qa")).items()}
    if qa:
        parts += ["", f"## Question answering{meaningless}", "", qa_table(qa)]
        failed = sum(int(_d(m).get("failed") or 0) for m in qa.values())
        if failed:
            parts += ["", f"**{failed} answers failed in the LLM backend after retries.** They are not scored "
                      "(not counted as wrong either); re-run the same command to retry them."]
        for method, m in qa.items():
            for note in m.get("notes") or []:
                parts.append(f"- {md_escape(method)}: {md_escape(note)}")
            if _d(m.get("by_type")) and all(isinstance(v, dict) for v in m["by_type"].values()):
                types = sorted(m["by_type"])
                parts += [
                    "",
                    f"### {md_escape(method)}: F1 by type",
                    "",
                    _md_table(["type", "n", "F1"] + (["judge"] if any("judge_accuracy" in m["by_type"][t] for t in types) else []),
                              [[t, _n(m["by_type"][t].get("n")), _fmt(m["by_type"][t].get("f1"))]
                               + ([_fmt(m["by_type"][t].get("judge_accuracy"))] if "judge_accuracy" in m["by_type"][t] else [])
                               for t in types]),
                ]
    record = [r for r in metrics.get("record") or [] if isinstance(r, dict)]
    if record:
        rows = [[r.get("stage", "?"), r.get("status", "?"), str(r.get("units_done", "")), str(r.get("units_resumed", "")),
                 str(r.get("fingerprint", ""))] for r in record]
        parts += ["", "## What ran", "", "A stage is skipped when its outputs were computed under the same "
                  "fingerprint (same declared config fields and the same rows of the tables it reads).", "",
                  _md_table(["stage", "status", "units run", "units resumed", "fingerprint"], rows)]
        parts += ranked_lines(record)
    if _d(metrics.get("stages")):
        parts += ["", "## Stages", "", stage_table(metrics["stages"])]
    if _d(metrics.get("encoding")):
        parts += ["", "## Encoding (tokens per granularity)", "", encoding_table(metrics["encoding"]), "",
                  "Tokens of each text's encoder inputs (special tokens included, every window of `mean-windows`), "
                  "from the index's `embeddings` rows. A text whose truncated input equals another's (a session "
                  "whose first turn pair fills the window) shares its vector and is run once when both are in "
                  "one encode unit, but counts its own tokens here; a text in two rows (a one-pair session is "
                  "also its pair) counts in both, once in `all`."]
    if _d(metrics.get("tokens")):
        parts += ["", "## LLM tokens per method", "", tokens_table(metrics["tokens"]), "",
                  "construction: the memory the method reads (MemGAS summaries/keywords, JustMem cards) over the "
                  "bank's sessions; planner: JustMem plans over the bank's questions (methods that read them); "
                  "answer: the reader's prompts and answers of the method. LLM-free steps count 0."]
    jm = justmem_llm_table(_d(metrics.get("stages")))
    if jm:
        parts += ["", "## JustMem LLM outputs", "", jm, "",
                  "items stored: sessions with cards, questions with a plan. A fallback is an output still invalid "
                  "after one repair call, replaced by the LLM-free cards or plan and recorded in the row's "
                  "`fallback`; a call that failed in the backend stores nothing and is retried by the next run."]
    profiles = _d(metrics.get("profiles"))
    if profiles:
        names = sorted({p for v in profiles.values() if isinstance(v, dict) for p in v})
        rows = [[t, *(_n(v.get(p, 0)) for p in names)] for t, v in profiles.items() if isinstance(v, dict)]
        parts += ["", "## JustMem access profiles per question type", "", _md_table(["question type", *names], rows),
                  "", "The planner's profile per question (Replay if source fidelity is needed, Compose if the "
                  "evidence is distributed, Lookup otherwise); `justmem` reads with it, the fixed-profile "
                  "methods ignore it."]
    lat = _d(metrics.get("latency"))
    if lat:
        rows = [[k, _fmt(v.get("p50_ms"), 1), _fmt(v.get("p95_ms"), 1), str(v.get("n", "?"))]
                for k, v in lat.items() if isinstance(v, dict) and v]
        parts += ["", "## Query latency", "", _md_table(["step", "p50 ms", "p95 ms", "n"], rows)]
    for p in plots or []:
        parts += ["", f"![{p.stem}]({p.name})"]  # our own file names
    if plots_off:
        parts += ["", "Plots are off (`evaluation.plots=false`); `memgas report` on this directory draws them."]
    return "\n".join(parts) + "\n"


def load_metrics(run_dir: str | Path) -> dict[str, Any]:
    """A run's metrics.json, or a one-line MemgasError (missing, unreadable, corrupt, not an object)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MemgasError(f"{run_dir}: " + ("not a directory" if run_dir.exists() else "no such run directory"))
    path = run_dir / "metrics.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise MemgasError(f"{run_dir}: no metrics.json (run `memgas run` or `memgas answer` first)") from None
    except IsADirectoryError:
        raise MemgasError(f"{path}: is a directory, expected a JSON file") from None
    try:
        metrics = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MemgasError(f"{path}: corrupt metrics.json ({str(exc).splitlines()[0]}); re-run "
                          "`memgas answer` to rewrite it") from None
    if not isinstance(metrics, dict):
        raise MemgasError(f"{path}: corrupt metrics.json (expected a JSON object, got {type(metrics).__name__})")
    problem = metrics_problem(metrics)
    if problem:
        raise MemgasError(f"{path}: corrupt metrics.json ({problem}); re-run `memgas answer` to rewrite it")
    return metrics


#: fields the report prints as text: a number or an object there is not a metrics.json memgas wrote
_TEXT_FIELDS = {
    "run": ("name", "encoder", "generator", "llm", "router", "version", "git_commit"),
    "dataset": ("path", "sha256", "format"),
}


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def metrics_problem(metrics: dict[str, Any]) -> str | None:
    """The first field of ``metrics`` whose type the report cannot print (None: all fine). Sections are
    otherwise read leniently (a missing metric prints as "–"), so only what would crash is checked."""
    for section in ("run", "dataset", "retrieval", "qa", "stages", "latency", "encoding", "notes", "tokens", "profiles"):
        if metrics.get(section) is not None and not isinstance(metrics[section], dict):
            return f"{section} should be an object, got {_json_type(metrics[section])}"
    for section, keys in _TEXT_FIELDS.items():
        for k in keys:
            v = (metrics.get(section) or {}).get(k)
            if v is not None and not isinstance(v, str):
                return f"{section}.{k} should be a string, got {_json_type(v)}"
    for method, m in (metrics.get("qa") or {}).items():
        if not isinstance(m, dict):
            continue
        notes = m.get("notes")
        if notes is not None and not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
            return f"qa.{method}.notes should be an array of strings"
        failed = m.get("failed")
        if failed is not None and _num(failed) is None:
            return f"qa.{method}.failed should be a number, got {_json_type(failed)}"
    record = metrics.get("record")
    if record is not None and not isinstance(record, list):
        return f"record should be an array, got {_json_type(record)}"
    for i, r in enumerate(record or []):
        for k in ("stage", "status", "fingerprint"):
            v = r.get(k) if isinstance(r, dict) else None
            if v is not None and not isinstance(v, str):
                return f"record[{i}].{k} should be a string, got {_json_type(v)}"
    return None


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically to ``path`` (a one-line error if ``path`` is a directory)."""
    from memgas.pipeline.bank import atomic_write_bytes

    p = Path(path)
    if p.is_dir():
        raise MemgasError(f"{p}: is a directory; give a file path for the report")
    if p.exists() and not p.is_file():  # /dev/stdout, a pipe: write into it, never replace it
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
        return p
    if not p.parent.is_dir():
        raise MemgasError(f"{p}: the directory {p.parent} does not exist")
    atomic_write_bytes(p, text.encode("utf-8"), point="report:write")
    return p


COMPARISON_TITLE = "# memgas run comparison"


def write_comparison(path: str | Path, text: str) -> Path:
    """``memgas report --out PATH``: write the comparison, replacing only an earlier comparison (its
    first line says so); a run's metrics.json, its report.md or any other file is refused, not replaced."""
    p = Path(path)
    if p.is_file():
        try:
            with open(p, "rb") as f:
                head = f.read(len(COMPARISON_TITLE.encode()))
        except OSError:
            head = b""
        if head != COMPARISON_TITLE.encode():
            raise MemgasError(f"--out {p}: exists and is not a comparison written by `memgas report`; refusing "
                              "to overwrite it (give a new file name)")
    return write_text(p, text)


def write_report(run_dir: str | Path, plots: bool = True) -> Path:
    """``report.md`` of a run directory from its metrics.json, with its plots (:func:`plot_run`) unless
    ``plots`` is off: then plots of an earlier run in this directory are removed (memgas's own files, which
    would no longer match the report) and the report says how to draw them."""
    run_dir = Path(run_dir)
    metrics = load_metrics(run_dir)
    if plots:
        drawn = plot_run(metrics, run_dir)
    else:
        drawn = []
        for name in PLOT_FILES:
            (run_dir / name).unlink(missing_ok=True)
    return write_text(run_dir / "report.md", render_markdown(metrics, drawn, plots_off=not plots))


def dataset_differences(runs: dict[str, dict[str, Any]]) -> str | None:
    """A sentence when the runs did not all use the same data, else None: by ``content_sha256`` (the bank's
    rows, however they were split into an ingest and appends) when every run records it, else by the
    dataset file's (or ingest history's) sha256."""
    content = {name: _d(m.get("dataset")).get("content_sha256") for name, m in runs.items()}
    shas = content if all(content.values()) else {name: _d(m.get("dataset")).get("sha256") for name, m in runs.items()}
    known = {v for v in shas.values() if v}
    if len(known) <= 1 and all(shas.values()):
        return None
    parts = []
    for name, m in runs.items():
        ds = _d(m.get("dataset"))
        label = Path(str(ds.get("path"))).name if ds.get("path") else "?"
        if isinstance(ds.get("appends"), list) and ds["appends"]:
            label += f" + {len(ds['appends'])} appended"
        sha = str(ds.get("sha256") or "unknown")[:12]
        lim = f", limit {ds['limit']}" if ds.get("limit") is not None else ""
        parts.append(md_escape(f"{name}: {label} (sha256 {sha}{lim})"))
    if len(known) > 1:
        return "**Warning: these runs used different datasets; their numbers are not comparable.** " + "; ".join(parts)
    return ("**Note: not every run records its dataset (no sha256 in metrics.json), so whether they used the same "
            "data cannot be checked.** " + "; ".join(parts))


def compare_runs(run_dirs: list[str | Path], metric: str = "recall_all@5") -> str:
    """Side-by-side table: one row per (run, method), headline retrieval and QA metrics. Says so when the
    runs used different dataset files (sha256 in each run's metrics.json ``dataset`` section)."""
    runs: dict[str, dict[str, Any]] = {}
    for d in run_dirs:
        name = Path(d).name or str(d)
        while name in runs:  # two runs with the same folder name: show the path
            name = str(d)
            if name in runs:
                name += "'"
        runs[name] = load_metrics(d)
    rows = []
    for name, m in runs.items():
        level = _d(_d(m.get("retrieval")).get("session"))
        for method, r in level.items():
            o = _d(_d(r).get("overall"))
            qa = _d(_d(_d(m.get("qa")).get(method)).get("overall"))
            label = f"{name} (synthetic encoder: meaningless)" if m.get("synthetic_encoder") else name
            rows.append([label, method] + [_fmt(o.get(f"recall_all@{k}")) for k in HEADLINE_KS]
                        + [_fmt(o.get(f"ndcg_any@{k}")) for k in (5, 10)] + [_fmt(qa.get("f1"))])
    header = ["run", "method"] + [f"R_all@{k}" for k in HEADLINE_KS] + ["NDCG@5", "NDCG@10", "QA F1"]
    warning = dataset_differences(runs)
    head = COMPARISON_TITLE + "\n\n" + (warning + "\n\n" if warning else "")
    if warning:
        log.warning("%s", warning.replace("**", ""))
    return head + _md_table(header, rows) + "\n"

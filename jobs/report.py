"""Reports of a run: ``report.md`` tables for people and PNG plots, from ``metrics.json``.

metrics.json layout (written by :mod:`memgas.jobs.main_job`)::

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
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEADLINE_KS = (1, 3, 5, 10)


def _fmt(v: Any, scale: float = 100.0) -> str:
    if isinstance(v, (int, float)):
        return f"{v * scale:.1f}"
    return "–"


def _n(v: Any) -> str:
    return str(int(v)) if isinstance(v, (int, float)) else "?"


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def retrieval_table(level: dict[str, Any], ks: tuple[int, ...] = HEADLINE_KS) -> str:
    header = ["method"] + [f"R_all@{k}" for k in ks] + [f"R_any@{k}" for k in ks] + [f"NDCG@{k}" for k in ks]
    rows = []
    for method, m in level.items():
        o = m.get("overall", {})
        rows.append(
            [method]
            + [_fmt(o.get(f"recall_all@{k}")) for k in ks]
            + [_fmt(o.get(f"recall_any@{k}")) for k in ks]
            + [_fmt(o.get(f"ndcg_any@{k}")) for k in ks]
        )
    return _md_table(header, rows)


def by_type_table(level: dict[str, Any], metric: str = "recall_all@5") -> str:
    types = sorted({t for m in level.values() for t in m.get("by_type", {})})
    rows = [[method] + [_fmt(m.get("by_type", {}).get(t, {}).get(metric)) for t in types] for method, m in level.items()]
    return _md_table(["method"] + [f"{t} (n={_type_n(level, t)})" for t in types], rows)


def _type_n(level: dict[str, Any], t: str) -> Any:
    for m in level.values():
        n = m.get("by_type", {}).get(t, {}).get("n")
        if n is not None:
            return int(n)
    return "?"


def qa_table(qa: dict[str, Any]) -> str:
    metrics = ["f1", "exact_match", "bleu4", "rouge1", "rouge2", "rougeL", "judge_accuracy", "bertscore_f1"]
    present = [k for k in metrics if any(k in m.get("overall", {}) for m in qa.values())]
    rows = [[method, _n(m.get("n"))] + [_fmt(m.get("overall", {}).get(k)) for k in present] for method, m in qa.items()]
    return _md_table(["method", "n"] + present, rows)


def stage_table(stages: dict[str, Any]) -> str:
    rows = []
    for name, s in stages.items():
        rows.append(
            [
                name,
                f"{s.get('wall_s', 0):.1f}",
                f"{s.get('cpu_s', 0):.1f}",
                f"{s.get('peak_rss_mb', 0):.0f}",
                str(s.get("items", 0)),
                f"{s.get('items_per_s', 0):.1f}",
                f"{s.get('tokens_per_s', 0):.0f}",
                str(s.get("skipped", 0)),
            ]
        )
    return _md_table(["stage", "wall s", "cpu s", "peak RSS MB", "items", "items/s", "tokens/s", "cached/skipped"], rows)


def plot_run(metrics: dict[str, Any], out_dir: Path) -> list[Path]:
    """Recall@K curves per method, per-type bars, and the stage time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    level = metrics.get("retrieval", {}).get("session", {})
    if level:
        ks = sorted({int(k.split("@")[1]) for m in level.values() for k in m.get("overall", {}) if k.startswith("recall_all@")})
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method, m in level.items():
            ax.plot(ks, [100 * m["overall"].get(f"recall_all@{k}", float("nan")) for k in ks], marker="o", label=method)
        ax.set_xscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K (sessions retrieved)")
        ax.set_ylabel("Recall_all@K (%)")
        ax.set_title("Session-level recall by method")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        written.append(out_dir / "recall_at_k.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

        types = sorted({t for m in level.values() for t in m.get("by_type", {})})
        if types:
            import numpy as np

            fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(types)), 4.5))
            width = 0.8 / max(1, len(level))
            x = np.arange(len(types))
            for i, (method, m) in enumerate(level.items()):
                vals = [100 * m.get("by_type", {}).get(t, {}).get("recall_all@5", float("nan")) for t in types]
                ax.bar(x + i * width, vals, width, label=method)
            ax.set_xticks(x + 0.4 - width / 2, types, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel("Recall_all@5 (%)")
            ax.set_title("Recall_all@5 by question type")
            ax.legend(fontsize=6, ncol=2)
            fig.tight_layout()
            written.append(out_dir / "recall_by_type.png")
            fig.savefig(written[-1], dpi=120)
            plt.close(fig)

    stages = metrics.get("stages", {})
    if stages:
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(stages) + 1.5))
        names = list(stages)
        ax.barh(names, [stages[n].get("wall_s", 0) for n in names], color="tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel("wall time (s)")
        ax.set_title("Stage time breakdown")
        fig.tight_layout()
        written.append(out_dir / "stage_times.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def render_markdown(metrics: dict[str, Any], plots: list[Path] | None = None) -> str:
    run = metrics.get("run", {})
    parts = [f"# memgas report: {run.get('name', '?')}", ""]
    info = [
        ("dataset", metrics.get("dataset", {}).get("path")),
        ("dataset sha256", metrics.get("dataset", {}).get("sha256")),
        ("encoder", run.get("encoder")),
        ("generator", run.get("generator")),
        ("reader LLM", run.get("llm")),
        ("router", run.get("router")),
        ("code", f"memgas {run.get('version', '?')} ({run.get('git_commit', '?')})"),
        ("wall time", f"{run.get('wall_s', 0):.1f} s"),
    ]
    parts += [f"- **{k}**: {v}" for k, v in info if v is not None]
    for level_name, level in metrics.get("retrieval", {}).items():
        if not level:
            continue
        any_m = next(iter(level.values()))
        parts += [
            "",
            f"## Retrieval ({level_name} level)",
            "",
            f"{any_m.get('n_evaluated', '?')} questions evaluated; skipped: {any_m.get('skipped', {})}. "
            "R_all = all evidence sessions in the top K (the paper's Recall@K); NDCG = LongMemEval's ndcg_any.",
            "",
            retrieval_table(level),
            "",
            "### Recall_all@5 by question type",
            "",
            by_type_table(level),
        ]
    qa = metrics.get("qa", {})
    if qa:
        parts += ["", "## Question answering", "", qa_table(qa)]
        for method, m in qa.items():
            for note in m.get("notes", []):
                parts.append(f"- {method}: {note}")
            if m.get("by_type"):
                types = sorted(m["by_type"])
                parts += [
                    "",
                    f"### {method}: F1 by type",
                    "",
                    _md_table(["type", "n", "F1"] + (["judge"] if any("judge_accuracy" in m["by_type"][t] for t in types) else []),
                              [[t, _n(m["by_type"][t].get("n")), _fmt(m["by_type"][t].get("f1"))]
                               + ([_fmt(m["by_type"][t].get("judge_accuracy"))] if "judge_accuracy" in m["by_type"][t] else [])
                               for t in types]),
                ]
    if metrics.get("stages"):
        parts += ["", "## Stages", "", stage_table(metrics["stages"])]
    lat = metrics.get("latency", {})
    if lat:
        rows = [[k, _fmt(v.get("p50_ms"), 1), _fmt(v.get("p95_ms"), 1), str(v.get("n", "?"))] for k, v in lat.items() if v]
        parts += ["", "## Query latency", "", _md_table(["step", "p50 ms", "p95 ms", "n"], rows)]
    for p in plots or []:
        parts += ["", f"![{p.stem}]({p.name})"]
    return "\n".join(parts) + "\n"


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
    except FileNotFoundError:
        from memgas.pipeline.errors import MemgasError

        raise MemgasError(f"{run_dir}: no metrics.json (run `memgas run` or `memgas answer` first)") from None
    plots = plot_run(metrics, run_dir)
    path = run_dir / "report.md"
    path.write_text(render_markdown(metrics, plots))
    return path


def compare_runs(run_dirs: list[str | Path], metric: str = "recall_all@5") -> str:
    """Side-by-side table: one row per (run, method), headline retrieval and QA metrics."""
    rows = []
    for d in run_dirs:
        m = json.loads((Path(d) / "metrics.json").read_text())
        level = m.get("retrieval", {}).get("session", {})
        for method, r in level.items():
            o = r.get("overall", {})
            qa = m.get("qa", {}).get(method, {}).get("overall", {})
            rows.append([Path(d).name, method] + [_fmt(o.get(f"recall_all@{k}")) for k in HEADLINE_KS]
                        + [_fmt(o.get(f"ndcg_any@{k}")) for k in (5, 10)] + [_fmt(qa.get("f1"))])
    header = ["run", "method"] + [f"R_all@{k}" for k in HEADLINE_KS] + ["NDCG@5", "NDCG@10", "QA F1"]
    return "# memgas run comparison\n\n" + _md_table(header, rows) + "\n"

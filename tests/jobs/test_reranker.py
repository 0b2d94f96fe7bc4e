"""Adding a stage is one module and one line: a re-ranker between rank and read, defined here and added to a
copy of the pipeline, runs, resumes, is fingerprinted and is skipped on a re-run; the readers of MemGAS's
rankings (read, evaluate) take its table while it is on, with no edit to any other file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.jobs import main_job, runner, tables
from memgas.jobs import stages as S
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import Stage, StageContext, command_slices
from memgas.jobs.units import chunk
from memgas.pipeline import faults
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.schema import RANKINGS

REPO = Path(__file__).resolve().parents[2]


class ReverseStage(Stage):
    """Re-ranks MemGAS's rankings: each question's top ``reading.top_k`` sessions in reverse order (the seed,
    a declared field, is added to every score), a few questions to a unit."""

    name = "reverse"
    reads = (tables.ranking("memgas"),)
    writes = (tables.Table("reversed", "fingerprint", "results", stored_in="rankings", ranks="memgas"),)
    fields = ("seed", "reading.top_k")

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        rankings = tables.read_current(ctx, "rankings", columns=["query_id"])
        return [{"queries": b} for b in chunk(sorted(set(rankings["query_id"].to_pylist())), 4)]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        rows = tables.read_current(ctx, "rankings", filter=pc.field("query_id").isin(unit["queries"])
                                   & (pc.field("rank") <= ctx.cfg.reading.top_k))
        return {"rows": rows.sort_by([("method", "ascending"), ("query_id", "ascending"), ("rank", "ascending")]),
                "seed": ctx.cfg.seed}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        out: list[dict[str, Any]] = []
        rows = payload["rows"].to_pylist()
        for key in dict.fromkeys((r["method"], r["query_id"]) for r in rows):
            mine = [r for r in rows if (r["method"], r["query_id"]) == key]
            out += [{**r, "rank": i + 1, "score": r["score"] + payload["seed"]} for i, r in enumerate(reversed(mine))]
        return {"rankings": pa.Table.from_pylist(out, schema=RANKINGS)}


def _with_reverse(pipeline: tuple[Any, ...]) -> tuple[Any, ...]:
    at = next(i for i, s in enumerate(pipeline) if s.name == "read")
    return (*pipeline[:at], ReverseStage(), *pipeline[at:])


PIPELINE = _with_reverse(S.PIPELINE)
INDEX, ANSWER = command_slices(PIPELINE)
REVERSE_AT = next(i for i, s in enumerate(PIPELINE) if s.name == "reverse")


def _cfg(out: Path, *extra: str) -> MemgasConfig:
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", [
        f"output_dir={out}", f"data.path={REPO / 'tests' / 'fixtures' / 'locomo_small.json'}", "data.limit=1",
        "retrieval.methods=[session]", "reading.methods=[session]", "reading.enabled=false", "reading.top_k=3",
        "evaluation.plots=false", *extra])


def _ctx(cfg: MemgasConfig, bank: Bank, results: Bank | None) -> StageContext:
    ctx = StageContext(cfg, bank, results, use_ray=False)
    resolve_stage_runtimes(ctx)
    return ctx


def _answer(cfg: MemgasConfig, bank: Bank, results: Bank) -> tuple[dict[str, dict[str, Any]], StageContext]:
    ctx = _ctx(cfg, bank, results)
    record = runner.run_stages(ctx, ANSWER, Profiler(), pipeline=PIPELINE)
    return {e["stage"]: e for e in record}, ctx


def test_a_reranker_is_one_module_and_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "reverse" in ANSWER and ANSWER.index("reverse") < ANSWER.index("read")
    cfg = _cfg(tmp_path)
    bank, _ = main_job.ensure_ingested(cfg, Profiler())
    runner.run_stages(_ctx(cfg, bank, None), INDEX, Profiler(), pipeline=PIPELINE)
    results = Bank.create(tmp_path / "results")
    # killed after its first unit: the next run resumes it
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MEMGAS_FAULT", "raise@reverse:unit-done#1")
    with pytest.raises(Exception, match="injected failure at reverse:unit-done"):
        _answer(cfg, bank, results)
    monkeypatch.delenv("MEMGAS_FAULT")
    got, ctx = _answer(cfg, bank, results)
    first = got["reverse"]
    assert first["status"] == "executed" and first["units_resumed"] == 1 and first["units_total"] > 1
    assert first["units_done"] == first["units_total"] - 1
    # its rows: rank's top reading.top_k of each question, reversed
    ranked = results.read("rankings", parts=tables.current_parts(ctx, "rankings"))
    mine = results.read("rankings", parts=tables.current_parts(ctx, "reversed"))
    q = ranked["query_id"][0].as_py()
    top = ranked.filter((pc.field("query_id") == q) & (pc.field("rank") <= 3)).sort_by("rank")
    again = mine.filter(pc.field("query_id") == q).sort_by("rank")
    assert again["session_id"].to_pylist() == top["session_id"].to_pylist()[::-1]
    assert mine.num_rows == ranked.filter(pc.field("rank") <= 3).num_rows
    # evaluate reads the re-ranked table in place of rank's: recall@1 is that of the reversed top 3
    metrics = ctx.stats["evaluate"]["metrics"]["retrieval"]["session"]["session"]
    evaluate = PIPELINE[-1]
    assert "reversed" in tables.declared_reads(ctx, evaluate) and "rankings" not in tables.declared_reads(ctx, evaluate)
    # a re-run skips it; a declared field changes its fingerprint, and so does what it reads
    again_run, _ = _answer(cfg, bank, results)
    assert again_run["reverse"]["status"] == "skipped" and again_run["reverse"]["fingerprint"] == first["fingerprint"]
    seeded, _ = _answer(_cfg(tmp_path, "seed=7"), bank, results)
    assert seeded["rank"]["status"] == "skipped" and seeded["reverse"]["status"] == "executed"
    assert seeded["reverse"]["fingerprint"] != first["fingerprint"]
    reverse = PIPELINE[REVERSE_AT]
    ctx.outputs["rank"] = "another"  # what it reads: rank's committed output
    assert runner.set_fingerprint(reverse, ctx)[0] != first["fingerprint"]
    # without it in the pipeline, evaluate reads rank's table (rank itself is unchanged: skipped)
    plain = _ctx(cfg, bank, results)
    runner.run_stages(plain, ("rank", "evaluate"), Profiler(), pipeline=S.PIPELINE)
    assert plain.stats["evaluate"]["metrics"]["retrieval"]["session"]["session"] != metrics

    # read, when on, takes its sessions from the re-ranker's table, which its fingerprint hashes
    read = next(s for s in PIPELINE if s.name == "read")
    reading = _ctx(_cfg(tmp_path, "reading.enabled=true"), bank, results)
    runner.run_stages(reading, ("rank", "reverse"), Profiler(), pipeline=PIPELINE[:PIPELINE.index(read)])
    reading.pipeline = PIPELINE
    fp, _ = runner.set_fingerprint(read, reading)
    assert "reversed" in tables.declared_reads(reading, read) and "rankings" not in tables.declared_reads(reading, read)
    with tables.reading_as(reading, read):
        payload = read.inputs(reading, {"method": "session", "queries": [q]})
    reading.outputs["reverse"] = "another"
    assert runner.set_fingerprint(read, reading)[0] != fp
    (entry,) = payload["queries"]
    assert [s["session_id"] for s in entry["sessions"]] == again["session_id"].to_pylist()

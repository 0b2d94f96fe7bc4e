"""The stage contract is all a new stage needs: a toy stage defined here, one class declaring
the tables it reads and writes, runs, resumes after a failure and is fingerprinted from its declared fields
and what it reads, with no edit anywhere else (its table's schema is registered here, as a new table's
would be in pipeline/schema.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from memgas.jobs import main_job, runner, tables
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.profiling import Profiler
from memgas.jobs.stage import Report, Stage, StageContext
from memgas.jobs.stages.ingest import IngestSource
from memgas.jobs.units import chunk
from memgas.pipeline import faults, schema
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig

REPO = Path(__file__).resolve().parents[2]
TOY = pa.schema([("session_id", pa.string()), ("position", pa.int64()), ("seed", pa.int64())])


class ToyStage(Stage):
    """Per session: its position in its history (and the seed, a declared field that changes the output),
    three sessions to a unit."""

    name = "toy"
    reads = ("sessions",)
    writes = (tables.Table("toy_counts", "fingerprint"),)
    fields = ("seed",)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        ids = sorted(ctx.bank.read("sessions", ["session_id"])["session_id"].to_pylist())
        return [{"sessions": b, "seed": ctx.cfg.seed} for b in chunk(ids, 3)]

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        s = ctx.bank.read("sessions", ["session_id", "position"], filter=pc.field("session_id").isin(unit["sessions"]))
        return {"rows": s.to_pylist(), "seed": unit["seed"]}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        rows = [{**r, "seed": payload["seed"]} for r in payload["rows"]]
        return {"toy_counts": pa.Table.from_pylist(rows, schema=TOY)}

    def finish(self, ctx: StageContext) -> dict[str, Any]:
        return {"rows": len(tables.current_parts(ctx, "toy_counts"))}


PIPELINE = (IngestSource(), ToyStage())


@pytest.fixture()
def bank_cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Bank, MemgasConfig]:
    monkeypatch.setitem(schema.TABLES, "toy_counts", TOY)
    cfg = _cfg(tmp_path)
    bank, _ = main_job.ensure_ingested(cfg, Profiler())
    return bank, cfg


def _cfg(out: Path, *extra: str) -> MemgasConfig:
    return MemgasConfig.load(REPO / "configs" / "demo.yaml", [
        f"output_dir={out}", f"data.path={REPO / 'tests' / 'fixtures' / 'locomo_small.json'}", "data.limit=1", *extra])


def _run(cfg: MemgasConfig, bank: Bank) -> tuple[dict[str, Any], StageContext]:
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    (entry,) = runner.run_stages(ctx, ["toy"], Profiler(), pipeline=PIPELINE)
    return entry, ctx


def test_a_toy_stage_runs_resumes_and_is_fingerprinted(bank_cfg, monkeypatch) -> None:
    bank, cfg = bank_cfg
    entry, ctx = _run(cfg, bank)
    sessions = bank.read("sessions", ["session_id", "position"]).sort_by("session_id").to_pylist()
    assert entry["status"] == "executed" and entry["units_total"] == entry["units_done"] == -(-len(sessions) // 3) > 2
    got = bank.read("toy_counts", parts=tables.current_parts(ctx, "toy_counts")).sort_by("session_id").to_pylist()
    assert got == [{**s, "seed": cfg.seed} for s in sessions]
    # the same config again: skipped; a field it does not declare: skipped
    assert _run(cfg, bank)[0]["status"] == "skipped"
    assert _run(_cfg(bank.path.parent, "association.topk_edges=3"), bank)[0]["status"] == "skipped"
    # a declared field changes its fingerprint; killed after its first unit, the next run resumes it
    seeded = _cfg(bank.path.parent, "seed=7")
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("MEMGAS_FAULT", "raise@toy:unit-done#1")
    with pytest.raises(Exception, match="injected failure at toy:unit-done"):
        _run(seeded, bank)
    monkeypatch.delenv("MEMGAS_FAULT")
    entry2, ctx2 = _run(seeded, bank)
    assert entry2["fingerprint"] != entry["fingerprint"]
    assert entry2["status"] == "executed" and entry2["units_resumed"] == 1
    assert entry2["units_done"] == entry["units_total"] - 1
    rows = bank.read("toy_counts", parts=tables.current_parts(ctx2, "toy_counts")).to_pylist()
    assert sorted(r["seed"] for r in rows) == [7] * len(sessions)
    assert bank.parts("toy_counts") == sorted(tables.current_parts(ctx2, "toy_counts"))  # the old seed's dropped
    # what it reads changed (another dataset): its fingerprint follows the source's
    other = runner.compute_fingerprints(StageContext(cfg, bank, None, use_ray=False), PIPELINE)
    bank.update_manifest(datasets=[{**bank.manifest["datasets"][-1], "sha256": "0" * 64}])
    assert runner.compute_fingerprints(StageContext(cfg, bank, None, use_ray=False), PIPELINE)["toy"] != other["toy"]


def test_the_contract_stays_small_and_the_library_never_needs_jobs() -> None:
    """Stage is at most twelve members; the stages package exports the pipeline and nothing else; pipeline/
    and kernels/ never import jobs/ (the library runs without the job layer)."""
    import memgas.jobs.stages as stages

    members = {n for n in vars(Stage) if not n.startswith("__")} | set(Stage.__annotations__)
    assert len(members) <= 12, sorted(members)
    assert stages.__all__ == ["ANSWER", "INDEX", "PIPELINE"]
    assert len(Path(stages.__file__).read_text().splitlines()) < 40
    offenders = [str(p.relative_to(REPO)) for d in ("pipeline", "kernels") for p in (REPO / d).rglob("*.py")
                 if "memgas.jobs" in p.read_text() or "from memgas import jobs" in p.read_text()]
    assert offenders == []


class CountStage(Stage):
    """Counts the toy stage's rows: it reads ``toy_counts``, and a subclass here forgets to say so."""

    name = "count"
    reads: tuple[str, ...] = ("sessions", "toy_counts")
    writes = (tables.Table("toy_totals", "fingerprint"),)

    def plan(self, ctx: StageContext) -> list[dict[str, Any]]:
        return [{"rows": ctx.bank.read("toy_counts", parts=tables.current_parts(ctx, "toy_counts")).num_rows}]

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        return {"toy_totals": pa.table({"session_id": ["all"], "position": [payload["rows"]], "seed": [0]},
                                       schema=TOY)}


class UndeclaredCountStage(CountStage):
    reads = ("sessions",)


@pytest.mark.parametrize("stage", [UndeclaredCountStage(), CountStage()], ids=["undeclared", "declared"])
def test_a_stage_opens_only_what_it_declares(bank_cfg, monkeypatch, stage) -> None:
    """A stage's driver code sees a bank that opens only the tables of what it reads (and writes): a read of
    a table it does not declare is refused with one line, before anything is written; declared, the table's
    output enters its fingerprint."""
    monkeypatch.setitem(schema.TABLES, "toy_totals", TOY)
    bank, cfg = bank_cfg
    pipeline = (*PIPELINE, stage)
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    if stage.reads == ("sessions",):
        with pytest.raises(tables.UndeclaredRead, match="stage 'count' opened table 'toy_counts', which it does "
                                                        "not read under this config"):
            runner.run_stages(ctx, ["toy", "count"], Profiler(), pipeline=pipeline)
        assert not bank.exists("toy_totals")
        return
    entry = {e["stage"]: e for e in runner.run_stages(ctx, ["toy", "count"], Profiler(), pipeline=pipeline)}
    assert entry["count"]["status"] == "executed"
    seeded = StageContext(_cfg(bank.path.parent, "seed=7"), bank, None, use_ray=False)
    resolve_stage_runtimes(seeded)
    again = {e["stage"]: e for e in runner.run_stages(seeded, ["toy", "count"], Profiler(), pipeline=pipeline)}
    assert again["count"]["status"] == "executed" and again["count"]["fingerprint"] != entry["count"]["fingerprint"]


def test_a_failed_give_back_of_ray_before_the_drivers_steps_loses_nothing(bank_cfg, caplog) -> None:
    """The job gives Ray back once the steps left are the driver's (after the last stage that may run on Ray,
    before the report): where that shutdown fails, the report still runs, in this process, and the failure is
    logged (the work is done; the Ray case: tests/jobs/test_ray_session.py)."""
    bank, cfg = bank_cfg
    seen: list[str] = []

    class Look(Report):
        name = "look"

        def report(self, ctx: StageContext) -> dict[str, Any]:
            seen.append(f"look use_ray={ctx.use_ray} toy_done={bool(tables.current_parts(ctx, 'toy_counts'))}")
            return {}

    Look.reads = ("toy_counts",)

    def release() -> None:
        seen.append("release")
        raise RuntimeError("the GCS is gone")

    ctx = StageContext(cfg, bank, None, use_ray=False)  # the toy in-process: it is still a task stage, so the
    resolve_stage_runtimes(ctx)                          # give-back comes after it
    with caplog.at_level("WARNING"):
        record = runner.run_stages(ctx, ["toy", "look"], Profiler(), pipeline=(*PIPELINE, Look()),
                                   release_ray=release)
    assert [e["status"] for e in record] == ["executed", "executed"]
    assert seen == ["release", "look use_ray=False toy_done=True"]
    assert "the GCS is gone" in caplog.text

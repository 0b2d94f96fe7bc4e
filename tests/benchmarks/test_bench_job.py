"""``bench_end_to_end.py`` through ``memgas run`` at a tiny size (3 questions x 4 sessions, every stage of the
demo config plus memgas-cards' graph, no Ray), and the scripts that read a finished run on that run:
``headline.py --run`` and ``memgas_cards_router.py``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from memgas.pipeline.bank import Bank

Run = Callable[..., tuple[object, str]]
METHODS = ["session", "turn", "hybrid", "memgas", "memgas-no-ppr", "cards", "justmem", "memgas-cards"]


@pytest.fixture(scope="module")
def e2e(run_bench: Run, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    work = tmp_path_factory.mktemp("e2e")
    _, out = run_bench("bench_end_to_end", "--questions", "3", "--sessions", "4", "--sample-sessions", "2",
                       "--no-ray", "--shard-size", "1", "--work-dir", str(work), "--keep",
                       "--set", f"retrieval.methods=[{','.join(METHODS)}]")
    return out, work / "LME-s" / "run"


def test_end_to_end_runs_every_stage_through_the_job(e2e: tuple[str, Path]) -> None:
    out, run = e2e
    m = json.loads((run / "metrics.json").read_text())
    executed = [r["stage"] for r in m["record"] if r.get("status") == "executed"]
    assert {"ingest", "generate", "cards", "plan", "nodes", "encode", "card-encode", "associate",
            "card-graph-associate", "rank", "card-rank", "card-graph-rank", "evaluate"} <= set(executed)
    for stage in executed:  # one row per stage, from the run's own profile
        row = rf"\n  {re.escape(stage)} +\d+ +items +[\d.]+ +[\d.na]+  cpu [\d.]+ s, peak RSS \d+ MB"
        assert re.search(row, out), stage
    assert re.search(rf"memgas run \(whole\) +3 +questions .* {len(executed)} stages executed", out), out
    assert list(m["retrieval"]["session"]) == METHODS
    assert f"methods scored (session level)             8: {', '.join(METHODS)}" in out
    c = m["dataset"]["counts"]
    assert (c["sessions"], c["queries"]) == (12, 3) and Bank(run / "bank").count("queries") == 3
    assert f"session references / unique sessions       12 / {c['unique_sessions']}" in out
    assert re.search(r"model-time dedup saving +[\d.]+% \([\d.]+x\)", out), out


def test_headline_reads_a_finished_run(run_bench: Run, e2e: tuple[str, Path]) -> None:
    _, run = e2e
    rc, out = run_bench("headline", "--run", str(run))
    m = json.loads((run / "metrics.json").read_text())["retrieval"]["session"]
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith(f"{run}: commit ")
    assert lines[1] == "| method | R_all@5 | NDCG@10 | questions |"
    want = [f"| {x} | {100 * m[x]['overall']['recall_all@5']:.1f} | {100 * m[x]['overall']['ndcg@10']:.1f} | 3 |"
            for x in ("session", "turn", "hybrid", "memgas", "memgas-no-ppr", "cards", "justmem")]
    assert lines[3:] == want
    with pytest.raises(SystemExit) as e:
        run_bench("headline")  # neither a config nor --run
    assert e.value.code == 2


def test_memgas_cards_router_rebuilds_the_runs_ranking(run_bench: Run, e2e: tuple[str, Path]) -> None:
    _, run = e2e
    rc, out = run_bench("memgas_cards_router", str(run))
    assert rc == 0, out
    assert "== raw\n" in out and "== normalised (the run's setting)\n" in out
    assert out.count("share of the reset's mass on cards: ") == 2 and out.count("3 questions: R_all@3 ") == 2
    assert out.rstrip().endswith("the run's setting equals metrics.json's memgas-cards row: True")

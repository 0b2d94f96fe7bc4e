"""A failed LLM call in the JustMem cards or plan stage is retried, not frozen.

The LLM is the echo model behind the real OpenAI-compatible server and client. While the server answers every
chat request with HTTP 500, the run stops after the stage with exit 4 and stores nothing under the LLM key
(neither a card nor a plan: no LLM-free stand-in that a later run would take for the answer); once the server
has recovered, the next run in the same directory calls the LLM for those sessions and questions and exits 0.
The echo's replies are not JSON, so there every output is invalid after its repair: a recorded fallback,
counted in report.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memgas.jobs import cli
from memgas.pipeline.bank import Bank
from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR
from memgas.pipeline.justmem.plan import LLM_FREE_PLANNER
from memgas.pipeline.models.server import EchoLLM, Faults, serve_in_thread

from .conftest import REPO
from .test_justmem_llm_replies import _two_sessions


def _run(out: Path, data: Path, url: str, *extra: str) -> int:
    return cli.main(["run", str(REPO / "configs" / "demo.yaml"), "--no-ray", "-q", "--set", f"output_dir={out}",
                     "--set", f"data.path={data}", "--set", "data.limit=1", "--set", "reading.enabled=false",
                     "--set", "retrieval.methods=[justmem]", "--set", "llm.backend=openai",
                     "--set", "llm.model=echo", "--set", f"llm.base_url={url}", "--set", "llm.max_retries=0",
                     "--set", "encoder.max_tokens=64", *extra])


def _llm_rows(out: Path, table: str, column: str) -> list[dict]:
    bank = Bank(out / "bank")
    if not bank.exists(table):
        return []
    return [r for r in bank.read(table).to_pylist() if r[column].startswith("echo|")]


@pytest.mark.slow
def test_failed_cards_and_plan_calls_exit_4_store_nothing_and_are_retried(tmp_path: Path, capsys) -> None:
    data = tmp_path / "two.json"
    data.write_text(json.dumps(_two_sessions("What did Caroline say about the support group?")))
    out = tmp_path / "run"
    srv, _ = serve_in_thread(EchoLLM(), faults=Faults(fail_500=10**6))
    try:
        # 1. cards: every extraction call fails (HTTP 500): exit 4, no card under the LLM extractor's key
        rc = _run(out, data, srv.url, "--set", "justmem.extractor=llm", "--set", "justmem.planner=llm")
        err = capsys.readouterr().err
        assert rc == 4, err[-3000:]
        assert "cards: 2 sessions failed in the LLM backend" in err, err[-3000:]
        assert _llm_rows(out, "cards", "extractor") == []
        assert not (out / "bank" / "_stages" / "cards.json").exists()
        # 2. the plan, with the LLM-free cards: every planner call fails: exit 4, no plan row at all
        rc = _run(out, data, srv.url, "--set", "justmem.planner=llm")
        err = capsys.readouterr().err
        assert rc == 4, err[-3000:]
        assert "plan: 3 questions failed in the LLM backend" in err, err[-3000:]
        assert _llm_rows(out, "plans", "planner") == []
        assert not (out / "bank" / "_stages" / "plan.json").exists()
        # 3. the server has recovered: the same command as 1 calls the LLM for every session and question
        srv.faults = Faults()
        rc = _run(out, data, srv.url, "--set", "justmem.extractor=llm", "--set", "justmem.planner=llm")
        err = capsys.readouterr().err
        assert rc == 0, err[-3000:]
    finally:
        srv.shutdown()
        srv.server_close()
    cards = _llm_rows(out, "cards", "extractor")
    assert len({r["session_hash"] for r in cards}) == 2
    # an echo is no JSON: invalid after its repair, so a recorded fallback (with the call's tokens)
    assert all(r["fallback"].startswith(f"{LLM_FREE_EXTRACTOR} (invalid output after one repair") for r in cards)
    assert all(r["prompt_tokens"] > 0 for r in cards if r["card_index"] == 0)
    plans = _llm_rows(out, "plans", "planner")
    assert len(plans) == 3
    assert all(r["fallback"].startswith(f"{LLM_FREE_PLANNER} (invalid output after one repair") for r in plans)
    report = (out / "report.md").read_text()
    assert "| cards | 2 | 2 | 0 |" in report, report
    assert "| plan | 3 | 3 | 0 |" in report, report

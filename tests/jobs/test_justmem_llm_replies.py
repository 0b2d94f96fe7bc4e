"""A hostile LLM reply inside a whole run: recorded as an invalid output with the LLM-free
fallback, never the end of the run. The LLM is the echo model behind the real OpenAI-compatible server and
client: it answers with the prompt's words, so a question holding 100,000 opening brackets makes the
planner's reply nested 100,000 deep (the old parser raised RecursionError and the run exited 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memgas.jobs import cli
from memgas.pipeline.bank import Bank
from memgas.pipeline.justmem import structured
from memgas.pipeline.justmem.plan import LLM_FREE_PLANNER
from memgas.pipeline.models.server import EchoLLM, serve_in_thread

from .conftest import REPO

SMALL_LOCOMO = REPO / "tests" / "fixtures" / "locomo_small.json"


def _two_sessions(question: str) -> list[dict]:
    """The small LoCoMo file cut to its first two sessions and three questions (the run's cost is encoding),
    the first question replaced."""
    data = json.loads(SMALL_LOCOMO.read_text())
    conv = data[0]["conversation"]
    data[0]["conversation"] = {k: v for k, v in conv.items() if not k.startswith("session_")
                               or k.split("_")[1] in ("1", "2")}
    data[0]["qa"] = data[0]["qa"][:3]
    data[0]["qa"][0]["question"] = question
    for k in ("session_summary", "event_summary", "observation"):
        data[0][k] = {}
    return data


@pytest.mark.slow
def test_a_deeply_nested_planner_reply_is_recorded_and_the_run_ends_0(tmp_path: Path, capsys) -> None:
    data = _two_sessions('What did Caroline say about {"a": ' + "[" * 100_000)
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "run"
    srv, _ = serve_in_thread(EchoLLM())
    try:
        rc = cli.main(["run", str(REPO / "configs" / "demo.yaml"), "--no-ray", "-q", "--set", f"output_dir={out}",
                       "--set", f"data.path={path}", "--set", "data.limit=1", "--set", "reading.enabled=false",
                       "--set", "retrieval.methods=[justmem]", "--set", "justmem.planner=llm",
                       "--set", "llm.backend=openai", "--set", "llm.model=echo", "--set", f"llm.base_url={srv.url}",
                       "--set", "llm.max_retries=0", "--set", "encoder.max_tokens=64"])
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    plans = Bank(out / "bank").read("plans").to_pylist()
    deep = [r for r in plans if "nests deeper" in (r["fallback"] or "")]
    assert len(deep) == 1, [r["fallback"] for r in plans]
    # the repair call's echo (the repair instruction) holds no object either: the rules' plan, and why
    assert deep[0]["fallback"] == (f"{LLM_FREE_PLANNER} (invalid output after one repair: the reply holds no complete "
                               f"JSON object (first: the reply nests deeper than {structured.MAX_JSON_DEPTH} levels))")
    assert all(r["fallback"] is not None for r in plans)  # an echo is never a plan

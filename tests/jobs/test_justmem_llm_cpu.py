"""The LLM extractor and the LLM planner end to end on CPU with the real SmolLM2: one
`memgas run` with ``justmem.extractor=llm`` and ``justmem.planner=llm`` on the transformers backend, the JSON
schemas enforced while decoding. Two sessions of three turns and one question keep it to a few model calls.

Valid by construction: every card the LLM wrote parses and holds to its session's schema (turn numbers of the
session, at most the budgeted cards, strings within their budget), and no reply was cut at
``justmem.extract_max_tokens``; what the schema cannot say (the card's words must be its turns' words) is
``validate_cards``' grounding check, whose fallbacks are counted and named, never silent."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.justmem.extract import LLM_FREE_EXTRACTOR, extract_cards, turns_by_session
from memgas.pipeline.justmem.llm_cards import card_budget, session_cards_schema
from memgas.pipeline.models.llms import SMOLLM2_NAME

from .conftest import REPO
from .test_justmem_llm_replies import _two_sessions

TURNS_PER_SESSION = 3
#: what ``validate_cards`` may still reject in a schema-valid reply
SEMANTIC_PROBLEMS = ("is not grounded in turns", "holds no content words", "is after turn_end",
                     "repeats a sentence", "ends mid-sentence")


def _short_sessions() -> list[dict]:
    data = _two_sessions("When did Caroline go to the LGBTQ support group?")
    conv = data[0]["conversation"]
    for k in ("session_1", "session_2"):
        conv[k] = conv[k][:TURNS_PER_SESSION]
    data[0]["qa"] = data[0]["qa"][:1]
    return data


def _overrides(data: Path, out: Path) -> list[str]:
    return [f"output_dir={out}", f"data.path={data}", "data.limit=1", "reading.enabled=false",
            "retrieval.methods=[justmem,cards]", "justmem.planner=llm", "justmem.extractor=llm",
            # output budgets that bound each reply to one card / a short plan (the schemas hold them to it)
            "encoder.max_tokens=64", "justmem.extract_max_tokens=160", "justmem.plan_max_tokens=128",
            # runtime only (not in any key): one thread is several times faster on a loaded machine
            "llm.threads=1", "evaluation.plots=false"]


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory, cli) -> tuple[Path, list[str]]:
    """(output dir, overrides) of the one run both tests read."""
    tmp = tmp_path_factory.mktemp("justmem_llm_cpu")
    data = tmp / "short.json"
    data.write_text(json.dumps(_short_sessions()))
    out = tmp / "run"
    sets = _overrides(data, out)
    cli("run", str(REPO / "configs" / "demo.yaml"), "--no-ray", "-q", *[a for s in sets for a in ("--set", s)],
        timeout=1200)
    return out, sets


@pytest.mark.slow
def test_llm_plans_run_through_the_job_on_cpu_with_smollm2(llm_run) -> None:
    out, _ = llm_run
    bank = Bank(out / "bank")
    plans = [r for r in bank.read("plans").to_pylist() if r["planner"].startswith(f"{SMOLLM2_NAME}|")]
    assert len(plans) == 1
    # JSON valid under the schema by construction: never a parse or schema failure, never a fallback
    for r in plans:
        assert r["fallback"] is None, r["fallback"]
        json.loads(r["raw_output"])
    assert all(r["prompt_tokens"] > 0 for r in plans)
    metrics = json.loads((out / "metrics.json").read_text())
    assert {"justmem", "cards"} <= set(metrics["retrieval"]["session"])


@pytest.mark.slow
def test_llm_cards_run_through_the_job_on_cpu_with_smollm2_valid_and_deterministic(llm_run) -> None:
    out, sets = llm_run
    bank = Bank(out / "bank")
    cards = bank.read("cards")
    mine = cards.filter(pa.compute.starts_with(cards["extractor"], f"{SMOLLM2_NAME}|")).sort_by(
        [("session_hash", "ascending"), ("card_index", "ascending")])
    rows = mine.to_pylist()
    turns = turns_by_session(bank.read("turns"))
    assert {r["session_hash"] for r in rows} == set(turns) and len(turns) == 2
    cfg = MemgasConfig.load(REPO / "configs" / "demo.yaml", sets)
    from memgas.pipeline.models.factory import make_llm

    llm = make_llm(cfg.llm, seed=cfg.seed, device="cpu")
    llm_cards = fallbacks = 0
    for h, ts in turns.items():
        own = [r for r in rows if r["session_hash"] == h]
        assert [r["card_index"] for r in own] == list(range(len(own)))
        fb = own[0]["fallback"]
        if fb is not None:  # the LLM's cards failed a check no schema expresses: the LLM-free cards, and why
            fallbacks += 1
            assert fb.startswith(f"{LLM_FREE_EXTRACTOR} (invalid output after one repair: "), fb
            # never a reply that does not parse or breaks the schema (cut at the token budget, a turn number the
            # session lacks): only the card's words not being its turns' words, or a span given backwards
            assert any(p in fb.split("(first: ")[0] for p in SEMANTIC_PROBLEMS), fb
            continue
        llm_cards += len(own)
        schema = session_cards_schema(ts, card_budget(llm, ts, cfg.justmem.extract_max_tokens))
        reply = {"cards": [{"turn_start": r["turn_start"], "turn_end": r["turn_end"], "text": r["text"],
                            "type": r["type"], "time": r["time"] or ""} for r in own]}
        jsonschema.validate(reply, schema)
    print(f"SmolLM2 cards: {llm_cards} LLM cards, {fallbacks} of {len(turns)} sessions fell back")
    assert "## JustMem LLM outputs" in (out / "report.md").read_text()
    # deterministic: the library, in this process, writes the job's rows byte for byte
    sessions = [(h, turns[h], "locomo") for h in sorted(turns)]
    again = extract_cards(sessions, cfg.justmem, key=rows[0]["extractor"], llm=llm, temperature=cfg.llm.temperature,
                          seed=cfg.seed)
    assert again.sort_by([("session_hash", "ascending"), ("card_index", "ascending")]).to_pylist() == rows

"""Reading stage: filter once per query, answer once, token budget cuts, per-item failures recorded."""

from __future__ import annotations

import pytest

from memgas.pipeline.accounting import TokenLedger
from memgas.pipeline.config import ReadingConfig
from memgas.pipeline.models.base import GenerationResult
from memgas.pipeline.read import clean_answer, read_and_answer
from memgas.pipeline.schema import ANSWERS


def test_clean_answer() -> None:
    assert clean_answer("Answer: Miso\nQuestion: next?") == "Miso"
    assert clean_answer("  [bot]: Lisbon ") == "Lisbon"
    assert clean_answer("Answer:  Assistant: Answer:Rome\nQ: x") == "Rome"


def test_clean_answer_is_linear_on_repeated_prefixes() -> None:
    """8 MB of "Answer: " (a looping model behind a backend that ignores max_tokens): the old loop copied the
    rest of the answer once per prefix (quadratic, minutes). In a subprocess with a hang bound, not a timing
    assert."""
    import subprocess
    import sys

    code = "from memgas.pipeline.read import clean_answer\nprint(clean_answer('Answer: ' * 1_000_000 + 'Paris'))"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("clean_answer on 8 MB did not end within 20 s: not linear")
    assert (r.returncode, r.stdout) == (0, "Paris\n"), r.stderr[-2000:]


def test_an_answer_longer_than_max_tokens_allows_is_cut_before_it_is_stored() -> None:
    """A backend that ignores max_tokens (a looping model behind a server that does not cap it) answered 3.6 MB;
    it was stored whole and the QA metrics took ~35 s on it (ROUGE 25 s, BLEU 8 s): 200 s for 4 such answers in
    ``memgas answer``. An answer is cut at ANSWER_CHARS_PER_TOKEN characters per token of max_new_tokens, noted."""
    from memgas.pipeline.models.server import EchoLLM
    from memgas.pipeline.read import ANSWER_CHARS_PER_TOKEN

    flood = "word, more. " * 300_000
    llm = Recorder(EchoLLM(), lambda content: GenerationResult(text=flood, completion_tokens=8))
    t = read_and_answer([_q("a", "What did Melanie paint?")], llm, ReadingConfig(filter=False, max_new_tokens=8),
                        "memgas")
    row = t.to_pylist()[0]
    limit = ANSWER_CHARS_PER_TOKEN * 8
    assert row["hypothesis"] == flood[:limit].strip()
    assert row["error"] == f"answer cut to {limit} characters (the backend returned {len(flood)} for max_new_tokens 8)"


class Recorder:
    """The real LLM, recording each batch's prompt texts, with an optional fault injector ``corrupt(content)``
    that returns the result to report instead of the model's (or None to keep the model's). Replaced
    prompts do not reach the real model: their answers would be thrown away."""

    def __init__(self, llm, corrupt=None) -> None:
        self.llm, self.corrupt = llm, corrupt
        self.name, self.context_tokens = llm.name, llm.context_tokens
        self.batches: list[list[str]] = []

    def count_tokens(self, text: str) -> int:
        return self.llm.count_tokens(text)

    def generate(self, prompts, params):
        contents = [p[-1]["content"] for p in prompts]
        self.batches.append(contents)
        if not self.corrupt:
            return self.llm.generate(prompts, params)
        res = [self.corrupt(c) for c in contents]
        real = [i for i, r in enumerate(res) if r is None]
        if real:
            for i, r in zip(real, self.llm.generate([prompts[i] for i in real], params)):
                res[i] = r
        return res


def _q(qid: str, question: str, n_sessions: int = 3, long: bool = False) -> dict:
    body = "Melanie: I painted a lake sunrise. " * (300 if long else 1)
    return {
        "query_id": qid,
        "question": question,
        "question_date": "2023/06/01",
        "sessions": [
            {"session_id": f"{qid}-s{i}", "date": f"2023/05/0{i + 1}", "text": f"Caroline: fact {i}. {body}",
             "summary": f"summary {i}", "keywords": f"kw{i}; lake"}
            for i in range(n_sessions)
        ],
    }


@pytest.mark.slow
def test_filter_then_answer_with_budget_and_faults(smollm) -> None:
    def corrupt(content: str) -> GenerationResult | None:
        if content.startswith("You are an intelligent dialog bot. You will be shown History Dialogs. Please"):
            if "Q-empty" in content:
                return GenerationResult(text="   ", prompt_tokens=smollm.count_tokens(content))
            if "Q-error" in content:
                return GenerationResult(error="timeout")
        if "Q-empty" in content and "Filter" in content:
            return GenerationResult(text="@@@@ ####")
        return None  # the real model's answer

    llm = Recorder(smollm, corrupt)
    cfg = ReadingConfig(top_k=3, context_tokens=400, max_new_tokens=8)
    queries = [_q("a", "What did Melanie paint?", long=True), _q("b", "Q-empty?"), _q("c", "Q-error?")]
    ledger = TokenLedger()
    t = read_and_answer(queries, llm, cfg, "memgas", ledger=ledger, filter_max_tokens=24)
    assert t.schema == ANSWERS and t.num_rows == 3
    assert len(llm.batches) == 2 and all(len(b) == 3 for b in llm.batches)  # filter batch, answer batch
    for prompt in llm.batches[1]:
        assert smollm.count_tokens(prompt) + 8 <= 400
    rows = {r["query_id"]: r for r in t.to_pylist()}
    assert "context cut" in rows["a"]["error"] and rows["a"]["retrieved_session_ids"] == ["a-s0", "a-s1", "a-s2"]
    assert rows["b"]["hypothesis"] == "" and "answer unusable" in rows["b"]["error"]
    assert rows["c"]["hypothesis"] == "" and "timeout" in rows["c"]["error"]
    assert "filter output unusable" in rows["b"]["error"] and "Session Date" in rows["b"]["filtered_context"]
    assert ledger.stages["reading-filter"].requests == 3 and ledger.stages["reading-answer"].failures == 1
    assert ledger.stages["reading-answer"].counters["context_cut"] >= 1


@pytest.mark.slow
def test_no_filter_answers_once_with_dates(smollm) -> None:
    llm = Recorder(smollm)
    t = read_and_answer([_q("x", "When did Caroline state fact 1?", n_sessions=5)], llm,
                        ReadingConfig(top_k=2, filter=False, max_new_tokens=8), "session")
    assert len(llm.batches) == 1
    p = llm.batches[0][0]
    assert p.count("### Session Date") == 2 and "Session Summary" not in p and "Question Date: 2023/06/01" in p
    assert t.column("retrieved_session_ids").to_pylist() == [["x-s0", "x-s1"]]


def test_a_sessions_cards_are_read_with_it_within_the_budget() -> None:
    """memgas-cards' reader: a session's block holds its cards' lines under its date, before its text; blocks
    are dropped lowest-ranked first, cards with their session, and the top one alone is cut at its head, its
    cards first. Exact word counts of a one-word-a-token model at the budget's edges."""
    from memgas.pipeline.models.server import EchoLLM
    from memgas.pipeline.prompts import CARD_GRAPH_CARDS_HEAD, answer_prompt, session_block
    from memgas.pipeline.read import MARGIN, context_turn_keys

    q = _q("m", "What did Melanie paint?", n_sessions=3)
    for i, s in enumerate(q["sessions"]):
        s["cards"] = "\n".join(f"[{k}] (2023/05/0{i + 1}) Melanie painted lake {i}.{k}" for k in (1, 2))
    blocks = [session_block(s["date"], s["text"], cards=s["cards"]) for s in q["sessions"]]
    assert blocks[0] == ("\n### Session Date: 2023/05/01\nSession Cards:\n[1] (2023/05/01) Melanie painted lake 0.1\n"
                         "[2] (2023/05/01) Melanie painted lake 0.2\nSession Content:\n" + q["sessions"][0]["text"] + "\n")
    llm = EchoLLM()
    words = [llm.count_tokens("".join(blocks[:n])) for n in (1, 2, 3)]
    overhead = llm.count_tokens(answer_prompt("", q["question"], q["question_date"])[0]["content"]) + 8 + MARGIN

    def context(budget: int) -> str:
        cfg = ReadingConfig(top_k=3, filter=False, context_tokens=budget + overhead, max_new_tokens=8)
        return read_and_answer([q], llm, cfg, "memgas-cards").to_pylist()[0]["filtered_context"]

    assert context(words[2]) == "".join(blocks)
    assert context(words[2] - 1) == context(words[1]) == "".join(blocks[:2])
    assert context(words[1] - 1) == context(words[0]) == blocks[0]
    cut = context(words[0] - 6)  # the top block alone does not fit: its head, the cards' lines first
    assert blocks[0].startswith(cut) and llm.count_tokens(cut) <= words[0] - 6 and len(cut) < len(blocks[0])
    assert cut.startswith(f"\n### Session Date: 2023/05/01\n{CARD_GRAPH_CARDS_HEAD}{q['sessions'][0]['cards']}\n")
    # the report's evidence: the turns of the kept sessions; of a cut top session, those whose line is whole
    lengths = [[len(s["text"])] for s in q["sessions"]]  # one line each
    assert context_turn_keys(q["sessions"], blocks[0], 1, lengths) == [("m-s0", 0)]
    assert context_turn_keys(q["sessions"], "".join(blocks[:2]), 2, lengths) == [("m-s0", 0), ("m-s1", 0)]
    assert context_turn_keys(q["sessions"], cut, 1, lengths) == []

"""The ``justmem:`` config section: defaults in one place, bad values as one-line errors naming the key."""

from __future__ import annotations

import pytest

from memgas.pipeline.config import JustMemConfig, MemgasConfig
from memgas.pipeline.errors import ConfigError


def test_defaults_are_the_section_defaults() -> None:
    cfg = MemgasConfig.load(None)
    assert cfg.justmem == JustMemConfig()
    assert (cfg.justmem.extractor, cfg.justmem.planner, cfg.justmem.reranker) == ("llm-free", "llm-free", "bm25-dense")
    assert MemgasConfig.load(None, ["justmem.top_k=5", "justmem.rewrites=0"]).justmem.top_k == 5


@pytest.mark.parametrize("override, message", [
    ("justmem.top_k=0", "--set justmem.top_k=0: justmem.top_k: Input should be greater than or equal to 1 (got 0)"),
    ("justmem.candidates=-3", "--set justmem.candidates=-3: justmem.candidates: Input should be greater than or "
                              "equal to 1 (got -3)"),
    ("justmem.rewrites=3", "--set justmem.rewrites=3: justmem.rewrites: Input should be less than or equal to 2 (got 3)"),
    ("justmem.replay_tokens=lots", "--set justmem.replay_tokens=lots: justmem.replay_tokens: Input should be a valid "
                                   "integer, unable to parse string as an integer (got 'lots')"),
    ("justmem.reranker=cross", "--set justmem.reranker=cross: justmem.reranker: Input should be 'bm25-dense' or "
                               "'dense' (got 'cross')"),
    ("justmem.extractor=gpt", "--set justmem.extractor=gpt: justmem.extractor: Input should be 'llm-free' or 'llm' "
                              "(got 'gpt')"),
    ("justmem.planner=none", "--set justmem.planner=none: justmem.planner: Input should be 'llm-free' or 'llm' "
                             "(got 'none')"),
    ("justmem.top_k=60", "--set justmem.top_k=60: justmem.top_k=60 exceeds justmem.candidates=50: K final cards are "
                         "chosen from N candidates"),
    ("justmem.n=5", "--set justmem.n=5: justmem.n: unknown key (see pipeline/config.py for every key and its default)"),
])
def test_bad_values_are_one_line_errors(override, message) -> None:
    with pytest.raises(ConfigError) as e:
        MemgasConfig.load(None, [override])
    assert str(e.value) == message and "\n" not in str(e.value)


def test_bad_value_in_a_file_names_the_file(tmp_path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("justmem:\n  candidates: 5\n  top_k: 8\n")
    with pytest.raises(ConfigError) as e:
        MemgasConfig.load(p)
    assert str(e.value) == (f"{p}: justmem.top_k=8 exceeds justmem.candidates=5: K final cards are chosen from N "
                            "candidates")

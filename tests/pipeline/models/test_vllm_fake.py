"""vLLM offline backend: call shapes checked against a fake ``vllm`` module (vLLM is GPU-only and not
installed on CPU CI; this does not prove the real engine works, only that we call it as documented).

The fake is strict: its ``LLM``, ``LLM.chat``, ``SamplingParams`` and ``StructuredOutputsParams`` accept exactly
the parameters of the vLLM release the ``gpu`` extra pins (``tests/fixtures/vllm_api.json``, read from that
release's sources; see test_vllm_contract.py), so a renamed or removed argument fails here too."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from memgas.pipeline.models.base import SamplingParams

API = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "vllm_api.json").read_text())


def _check(what: str, given: Any, allowed: set[str]) -> None:
    unknown = set(given) - allowed
    if unknown:
        raise TypeError(f"vllm {API['vllm_version']} {what} got unexpected keyword(s) {sorted(unknown)}")


@dataclass
class _Comp:
    text: str
    token_ids: list[int]
    finish_reason: str = "stop"


@dataclass
class _Out:
    prompt_token_ids: list[int]
    outputs: list[_Comp] = field(default_factory=list)


class _Tok:
    def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in s.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)

    def apply_chat_template(self, msgs: Any, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return [1] * sum(len(m["content"].split()) + 3 for m in msgs)


class _FakeLLM:
    instances: list["_FakeLLM"] = []

    def __init__(self, model: str, **kw: Any) -> None:
        init = API["LLM.__init__"]
        # LLM forwards its **kwargs to EngineArgs: those fields are accepted too
        _check("LLM()", kw, set(init["params"]) | (set(API["EngineArgs"]) if init["var_keyword"] else set()))
        self.kw = {"model": model, **kw}
        self.calls: list[tuple[Any, Any, dict]] = []
        _FakeLLM.instances.append(self)

    def get_tokenizer(self) -> _Tok:
        return _Tok()

    def chat(self, convs: Any, sp: Any, **kw: Any) -> list[_Out]:
        assert API["LLM.chat"]["params"][:2] == ["messages", "sampling_params"]
        _check("LLM.chat()", kw, set(API["LLM.chat"]["params"][2:]))
        assert isinstance(sp, _FakeSP)
        self.calls.append((convs, sp, kw))
        return [_Out([0] * 7, [_Comp(f"answer {len(c)}", [1, 2, 3])]) for c in convs]


class _FakeSP:
    def __init__(self, **kw: Any) -> None:
        _check("SamplingParams()", kw, set(API["SamplingParams"]))
        if "structured_outputs" in kw:
            assert isinstance(kw["structured_outputs"], _FakeSO)
        self.kw = kw


class _FakeSO:
    def __init__(self, **kw: Any) -> None:
        _check("StructuredOutputsParams()", kw, set(API["StructuredOutputsParams"]))
        self.kw = kw


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType("vllm")
    mod.LLM = _FakeLLM  # type: ignore[attr-defined]
    mod.SamplingParams = _FakeSP  # type: ignore[attr-defined]
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.StructuredOutputsParams = _FakeSO  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    return mod


def test_vllm_call_shapes(fake_vllm: types.ModuleType) -> None:
    from memgas.pipeline.config import LLMConfig
    from memgas.pipeline.models.factory import make_llm

    llm = make_llm(LLMConfig(backend="vllm", model="some/model", tensor_parallel_size=2, context_tokens=64))
    eng = _FakeLLM.instances[-1]
    assert eng.kw["model"] == "some/model" and eng.kw["tensor_parallel_size"] == 2
    assert eng.kw["enable_prefix_caching"] is True and eng.kw["max_model_len"] == 64
    prompts = [[{"role": "user", "content": "hi there"}], [], [{"role": "user", "content": "word " * 200}]]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    res = llm.generate(prompts, SamplingParams(max_tokens=8, stop=("\n",), json_schema=schema))
    assert len(eng.calls) == 1  # the whole batch in one chat() call
    convs, sp, kw = eng.calls[0]
    assert len(convs) == 2 and kw.get("use_tqdm") is False
    assert sp.kw["max_tokens"] == 8 and sp.kw["temperature"] == 0.0 and sp.kw["stop"] == ["\n"]
    assert sp.kw["structured_outputs"].kw == {"json": schema}
    assert res[0].ok and res[0].text == "answer 1" and res[0].prompt_tokens == 7 and res[0].completion_tokens == 3
    assert res[1].error  # the empty prompt failed alone
    assert res[2].ok and res[2].extra.get("truncated") is True


def test_fake_is_strict(fake_vllm: types.ModuleType) -> None:
    """A keyword the pinned vLLM does not have fails, as the real class would."""
    with pytest.raises(TypeError, match="guided_decoding"):
        fake_vllm.SamplingParams(max_tokens=8, guided_decoding=object())
    with pytest.raises(TypeError, match="max_model_length"):
        fake_vllm.LLM(model="m", max_model_length=64)
    with pytest.raises(TypeError, match="show_progress"):
        fake_vllm.LLM(model="m").chat([], fake_vllm.SamplingParams(), show_progress=False)
    fake_vllm.LLM(model="m", max_model_len=64, enable_prefix_caching=True)  # EngineArgs fields pass

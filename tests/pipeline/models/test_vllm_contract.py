"""Contract tests: every keyword our vLLM backend passes exists in the vLLM release the `gpu` extra pins.

The parameter lists come from that release's own sources (``tests/fixtures/vllm_api.json``, written by this
file's ``__main__`` from the published wheel, read with ``ast``: nothing is imported). The checks:

- the fixture's version is the one ``pyproject.toml`` pins (a vLLM bump must regenerate the fixture);
- the keywords built by ``vllm_engine_kwargs``/``vllm_sampling_kwargs``/``VLLM_CHAT_KWARGS`` are parameters of
  ``LLM.__init__`` (or ``EngineArgs`` fields, where ``LLM`` forwards its ``**kwargs``), ``SamplingParams``,
  ``StructuredOutputsParams`` and ``LLM.chat``; the output attributes we read exist;
- where vLLM is importable (a GPU node set up with ``make setup-gpu``): its installed version and signatures
  equal the fixture, and the call sites build real ``EngineArgs``/``SamplingParams``/``StructuredOutputsParams``
  objects without starting an engine. Skipped here (vLLM is not installed on CPU machines).

Regenerate after a vLLM bump:

    pip download --no-deps --only-binary=:all: vllm==X.Y.Z -d /tmp/w
    python tests/pipeline/models/test_vllm_contract.py /tmp/w/vllm-X.Y.Z-*.whl > tests/fixtures/vllm_api.json
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import re
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

from memgas.pipeline.models.base import SamplingParams
from memgas.pipeline.models.llms import VLLM_CHAT_KWARGS, vllm_engine_kwargs, vllm_sampling_kwargs

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "vllm_api.json"


# -- reading the API out of a wheel (used by __main__ to write the fixture) -------------------------------


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise KeyError(f"class {name} not found")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise KeyError(f"{cls.name}.{name} not found")


def _params(fn: ast.FunctionDef) -> dict[str, Any]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg != "self"]
    return {"params": names, "var_keyword": a.kwarg is not None}


def _init_fields(cls: ast.ClassDef) -> list[str]:
    """Constructor fields of a dataclass / msgspec.Struct: annotated class attributes, minus ClassVars,
    ``field(init=False)`` and private (underscore) names."""
    out = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name.startswith("_") or "ClassVar" in ast.unparse(node.annotation):
            continue
        v = node.value
        if isinstance(v, ast.Call) and any(
            k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in v.keywords
        ):
            continue
        out.append(name)
    return out


def api_from_wheel(wheel: Path) -> dict[str, Any]:
    z = zipfile.ZipFile(wheel)
    src = lambda p: ast.parse(z.read(p).decode())  # noqa: E731
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    version = re.search(r"^Version: (\S+)$", meta, re.M).group(1)  # type: ignore[union-attr]
    llm = _class(src("vllm/entrypoints/llm.py"), "LLM")
    sp = src("vllm/sampling_params.py")
    outs = src("vllm/outputs.py")
    return {
        "vllm_version": version,
        "source": {"wheel": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                   "read_with": "ast (tests/pipeline/models/test_vllm_contract.py __main__)"},
        "LLM.__init__": _params(_method(llm, "__init__")),
        "LLM.chat": _params(_method(llm, "chat")),
        "LLM.get_tokenizer": _params(_method(llm, "get_tokenizer")),
        "EngineArgs": _init_fields(_class(src("vllm/engine/arg_utils.py"), "EngineArgs")),
        "SamplingParams": _init_fields(_class(sp, "SamplingParams")),
        "StructuredOutputsParams": _init_fields(_class(sp, "StructuredOutputsParams")),
        "RequestOutput": _params(_method(_class(outs, "RequestOutput"), "__init__"))["params"],
        "CompletionOutput": _init_fields(_class(outs, "CompletionOutput")),
    }


# -- the contract -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def pinned_vllm_version() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = [m.group(1) for r in extra if (m := re.fullmatch(r"\s*vllm\s*==\s*([\w.]+)\s*", r))]
    assert len(pins) == 1, f"the gpu extra must pin vllm exactly once (vllm==X.Y.Z), got {extra}"
    return pins[0]


def llm_init_accepts(api: dict[str, Any]) -> set[str]:
    """What ``vllm.LLM(**kw)`` accepts: its named parameters, plus ``EngineArgs`` fields via ``**kwargs``."""
    init = api["LLM.__init__"]
    return set(init["params"]) | (set(api["EngineArgs"]) if init["var_keyword"] else set())


def test_fixture_matches_the_pinned_release(api: dict[str, Any]) -> None:
    assert api["vllm_version"] == pinned_vllm_version(), (
        f"{FIXTURE.name} describes vllm {api['vllm_version']} but pyproject's gpu extra pins "
        f"vllm=={pinned_vllm_version()}: regenerate the fixture (see this file's docstring)")
    # sanity: the fixture was read from a real release, not left empty
    for key in ("LLM.__init__", "LLM.chat"):
        assert api[key]["params"], key
    assert {"model", "max_model_len", "enable_prefix_caching", "seed"} <= set(api["EngineArgs"])
    assert {"max_tokens", "temperature", "structured_outputs"} <= set(api["SamplingParams"])


def test_engine_kwargs_exist_in_pinned_vllm(api: dict[str, Any]) -> None:
    kw = vllm_engine_kwargs("some/model", context_tokens=4096, tensor_parallel_size=2,
                            gpu_memory_utilization=0.8, seed=3, enforce_eager=True)
    unknown = set(kw) - llm_init_accepts(api)
    assert not unknown, f"vllm {api['vllm_version']} LLM() does not accept {sorted(unknown)}"
    assert kw["enable_prefix_caching"] is True and kw["max_model_len"] == 4096


def test_sampling_and_chat_kwargs_exist_in_pinned_vllm(api: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    kw, structured = vllm_sampling_kwargs(SamplingParams(max_tokens=8, stop=("\n",), json_schema=schema), 8)
    assert not set(kw) - set(api["SamplingParams"]), set(kw) - set(api["SamplingParams"])
    assert "structured_outputs" in api["SamplingParams"]  # where _vllm_sampling_params puts the object
    assert structured == {"json": schema}
    assert not set(structured) - set(api["StructuredOutputsParams"])
    chat = set(api["LLM.chat"]["params"])
    assert {"messages", "sampling_params"} <= chat  # passed positionally, in this order
    assert api["LLM.chat"]["params"][:2] == ["messages", "sampling_params"]
    assert not set(VLLM_CHAT_KWARGS) - chat, set(VLLM_CHAT_KWARGS) - chat
    assert api["LLM.get_tokenizer"]["params"] == []


def test_output_attributes_we_read_exist(api: dict[str, Any]) -> None:
    assert {"prompt_token_ids", "outputs"} <= set(api["RequestOutput"])
    assert {"text", "token_ids", "finish_reason"} <= set(api["CompletionOutput"])


def test_renamed_argument_would_fail(api: dict[str, Any]) -> None:
    """The check has teeth: an argument vLLM does not have (e.g. the removed ``guided_decoding``) is caught."""
    assert "guided_decoding" not in api["SamplingParams"]
    assert "max_model_length" not in llm_init_accepts(api)


# -- against the installed vLLM (GPU nodes only) ----------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm not installed (GPU extra): real-object contract checks skipped")


@needs_vllm
def test_installed_vllm_matches_fixture(api: dict[str, Any]) -> None:
    import dataclasses

    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    assert vllm.__version__.split("+")[0] == api["vllm_version"], (vllm.__version__, api["vllm_version"])
    init = inspect.signature(vllm.LLM.__init__).parameters
    assert [p for p in init if p not in ("self", "kwargs")] == api["LLM.__init__"]["params"]
    chat = inspect.signature(vllm.LLM.chat).parameters
    assert [p for p in chat if p != "self"] == api["LLM.chat"]["params"]
    fields = [f.name for f in dataclasses.fields(vllm.EngineArgs) if f.init and not f.name.startswith("_")]
    assert fields == api["EngineArgs"]
    so = [f.name for f in dataclasses.fields(StructuredOutputsParams) if f.init and not f.name.startswith("_")]
    assert so == api["StructuredOutputsParams"]
    assert set(api["SamplingParams"]) <= set(vllm.SamplingParams.__struct_fields__)


@needs_vllm
def test_call_sites_build_real_vllm_objects() -> None:
    """EngineArgs/SamplingParams/StructuredOutputsParams built from our kwargs; no engine is started."""
    import vllm

    from memgas.pipeline.models.llms import _vllm_sampling_params

    kw = vllm_engine_kwargs("some/model", context_tokens=4096, tensor_parallel_size=1, seed=0)
    engine_args = vllm.EngineArgs(**kw)
    assert engine_args.max_model_len == 4096 and engine_args.enable_prefix_caching is True
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    sp = _vllm_sampling_params(vllm, SamplingParams(max_tokens=8, stop=("\n",), json_schema=schema), 8)
    assert isinstance(sp, vllm.SamplingParams)
    assert sp.max_tokens == 8 and sp.temperature == 0.0 and sp.stop == ["\n"]
    assert sp.structured_outputs is not None and sp.structured_outputs.json == schema


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(json.dumps(api_from_wheel(Path(sys.argv[1])), indent=1))

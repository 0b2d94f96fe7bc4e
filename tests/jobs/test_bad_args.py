"""Bad arguments and bad files, for every command: one line on stderr, the right exit code, no traceback,
and the bank and the run directory untouched.

Each row runs `memgas` in-process through ``cli.main`` (tests/jobs/conftest.py: the console script's working
directory, environment and stderr with the CLI's own log handler; test_cli.py keeps real-process smoke
tests). To add a case, add a row to CASES: ``(id, args, exit code, words the error line must hold)``; args
may name the prepared files below in braces ({bank}, {run}, {file}, ...). Every case must fail during
validation: no model is loaded and no Ray is started, so the whole table runs in a few seconds.
docs/reliability.md lists the cases and what each gets.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from memgas.pipeline.ingest import ingest
from memgas.pipeline.locks import LOCK

from .conftest import run_memgas

REPO = Path(__file__).resolve().parents[2]
SAMPLE3 = REPO / "data" / "sample" / "longmemeval_s_sample3.json"
DEMO = REPO / "configs" / "demo.yaml"

# (id, args, exit code, words of the error line). 2: bad input; 3: the environment.
CASES: list[tuple[str, list[str], int, str]] = [
    # top level
    ("unknown-command", ["bogus"], 2, "invalid choice"),
    ("unknown-option", ["--bogus"], 2, "unrecognized arguments"),
    # ingest
    ("ingest-missing-file", ["ingest", "{nope}", "--out", "{new}"], 2, "no such file"),
    ("ingest-file-is-dir", ["ingest", "{dir}", "--out", "{new}"], 2, "not a regular file"),
    ("ingest-limit-negative", ["ingest", "{sample}", "--out", "{new}", "--limit", "-1"], 2, "--limit"),
    ("ingest-limit-not-int", ["ingest", "{sample}", "--out", "{new}", "--limit", "ten"], 2, "--limit"),
    ("ingest-bad-format", ["ingest", "{sample}", "--format", "csv", "--out", "{new}"], 2, "invalid choice"),
    ("ingest-no-out", ["ingest", "{sample}"], 2, "--out"),
    ("ingest-out-is-file", ["ingest", "{sample}", "--out", "{file}"], 2, "not a directory"),
    ("ingest-out-not-a-bank", ["ingest", "{sample}", "--out", "{notbank}"], 2, "not a memory bank"),
    ("ingest-nesting-bomb", ["ingest", "{deep}", "--format", "longmemeval", "--out", "{new}"], 2, "nested deeper"),
    ("ingest-nesting-bomb-jsonl", ["ingest", "{deepl}", "--out", "{new}"], 2, "nested too deeply"),
    ("ingest-duplicate-key", ["ingest", "{dupkey}", "--format", "locomo", "--out", "{new}"], 2, "duplicate key"),
    ("ingest-huge-number", ["ingest", "{bignum}", "--format", "longmemeval", "--out", "{new}"], 2, "out of range"),
    ("ingest-binary", ["ingest", "{binary}", "--format", "locomo", "--out", "{new}"], 2, "expected a JSON array"),
    ("ingest-undetectable", ["ingest", "{file}", "--out", "{new}"], 2, "cannot tell the format"),
    ("ingest-bad-file-into-bank", ["ingest", "{truncated}", "--format", "longmemeval", "--out", "{bank}"], 2, "truncated"),
    ("ingest-conflicting-session", ["ingest", "{conflict}", "--out", "{bank}"], 2, "different content"),
    # stats
    ("stats-missing", ["stats", "{nope}"], 2, "not a memory bank"),
    ("stats-file", ["stats", "{file}"], 2, "not a memory bank"),
    ("stats-not-a-bank", ["stats", "{dir}"], 2, "not a memory bank"),
    ("stats-corrupt-manifest", ["stats", "{badbank}"], 2, "corrupt manifest"),
    # synth
    ("synth-questions-negative", ["synth", "{new}", "--questions", "-1"], 2, "--questions"),
    ("synth-sessions-zero", ["synth", "{new}", "--sessions", "0"], 2, "--sessions"),
    ("synth-turns-zero", ["synth", "{new}", "--turns", "0"], 2, "--turns"),
    ("synth-reuse-above-1", ["synth", "{new}", "--reuse", "2"], 2, "--reuse"),
    ("synth-multi-negative", ["synth", "{new}", "--multi-session", "-0.1"], 2, "--multi-session"),
    ("synth-seed-not-int", ["synth", "{new}", "--seed", "x"], 2, "--seed"),
    ("synth-out-is-dir", ["synth", "{dir}"], 2, "is a directory"),
    ("synth-out-under-file", ["synth", "{file}/x.json"], 2, "is a file"),
    # report
    ("report-missing-run", ["report", "{nope}"], 2, "no such run directory"),
    ("report-no-metrics", ["report", "{dir}"], 2, "no metrics.json"),
    ("report-corrupt-metrics", ["report", "{badrun}"], 2, "corrupt metrics.json"),
    ("report-metrics-not-object", ["report", "{listrun}"], 2, "expected a JSON object"),
    ("report-out-is-dir", ["report", "{run}", "{run}", "--out", "{dir}"], 2, "is a directory"),
    ("report-out-missing-dir", ["report", "{run}", "{run}", "--out", "{nope}/cmp.md"], 2, "does not exist"),
    ("report-disk-full", ["report", "{run}", "{run}", "--out", "/dev/full"], 3, "No space left on device"),
    ("report-out-over-metrics", ["report", "{run}", "{run}", "--out", "{run}/metrics.json"], 2, "refusing to overwrite"),
    # serve
    ("serve-port-too-big", ["serve", "--port", "70000"], 2, "--port"),
    ("serve-port-negative", ["serve", "--port", "-1"], 2, "--port"),
    ("serve-max-queue-negative", ["serve", "--max-queue", "-1"], 2, "argument --max-queue: must be >= 0, got -1"),
    ("serve-bad-config-value", ["serve", "--set", "llm.concurrency=0"], 2, "llm.concurrency"),
    ("serve-unknown-backend", ["serve", "--set", "llm.backend=bogus"], 2, "llm.backend"),
    ("serve-config-is-dir", ["serve", "--config", "{dir}"], 2, "is a directory"),
    ("serve-port-in-use", ["serve", "--port", "{busy_port}"], 3, "Address already in use"),
    # index
    ("index-missing-bank", ["index", "{nope}", "--config", "{demo}"], 2, "not a memory bank"),
    ("index-bank-is-file", ["index", "{file}", "--config", "{demo}"], 2, "not a memory bank"),
    ("index-bad-set", ["index", "{bank}", "--config", "{demo}", "--set", "association.mem_threshold=1"], 2,
     "--set association.mem_threshold=1"),
    ("index-config-binary", ["index", "{bank}", "--config", "{binary}"], 2, "not a text file"),
    ("index-config-not-yaml", ["index", "{bank}", "--config", "{badyaml}"], 2, "not valid YAML"),
    ("index-unknown-key", ["index", "{bank}", "--config", "{demo}", "--set", "retrieval.bogus=1"], 2, "unknown key"),
    ("index-set-without-value", ["index", "{bank}", "--set", "retrieval.num_seeds"], 2, "KEY=VALUE"),
    # answer
    ("answer-unknown-method", ["answer", "{bank}", "--method", "bogus"], 2, "invalid choice"),
    ("answer-missing-bank", ["answer", "{nope}", "--config", "{demo}"], 2, "not a memory bank"),
    ("answer-out-is-file", ["answer", "{bank}", "--config", "{demo}", "--out", "{file}"], 2, "not a directory"),
    ("answer-store-top-below-ks", ["answer", "{bank}", "--set", "retrieval.store_top=5"], 2, "evaluation.ks"),
    ("answer-empty-ks", ["answer", "{bank}", "--set", "evaluation.ks=[]"], 2, "evaluation.ks"),
    # run / profile
    ("run-missing-config", ["run", "{nope}"], 2, "not found"),
    ("run-config-is-dir", ["run", "{dir}"], 2, "is a directory"),
    ("run-config-binary", ["run", "{binary}"], 2, "not a text file"),
    ("run-config-not-mapping", ["run", "{file}"], 2, "expected a mapping"),
    ("run-temp-zero", ["run", "{demo}", "--set", "retrieval.temp=0"], 2, "retrieval.temp"),
    ("run-seeds-negative", ["run", "{demo}", "--set", "retrieval.num_seeds=-1"], 2, "retrieval.num_seeds"),
    ("run-damping-one", ["run", "{demo}", "--set", "retrieval.damping=1"], 2, "retrieval.damping"),
    ("run-max-questions-negative", ["run", "{demo}", "--set", "reading.max_questions=-1"], 2, "reading.max_questions"),
    # GPU work that Ray workers would get without a GPU: refused before Ray starts
    ("run-vllm-without-gpus", ["run", "{demo}", "--set", "output_dir={new}", "--set", "llm.backend=vllm"], 2,
     "ray.num_gpus_per_model_actor=0"),
    ("run-cuda-encoder-without-gpus", ["run", "{demo}", "--set", "output_dir={new}", "--set", "encoder.device=cuda"], 2,
     "encoder.device=cuda"),
    ("run-cuda-kernels-without-gpus", ["run", "{demo}", "--set", "output_dir={new}", "--set", "retrieval.device=cuda",
                                       "--set", "ray.num_gpus_per_task=0"], 2, "ray.num_gpus_per_task=0"),
    ("run-reading-unknown-method", ["run", "{demo}", "--set", "reading.methods=[bogus]"], 2, "bogus"),
    ("run-reading-method-not-ranked", ["run", "{demo}", "--set", "retrieval.methods=[session]"], 2, "does not rank"),
    ("run-shard-size-zero", ["run", "{demo}", "--set", "ray.shard_size=0"], 2, "ray.shard_size"),
    ("run-tp-over-gpus", ["run", "{demo}", "--set", "llm.backend=vllm", "--set", "llm.tensor_parallel_size=4",
                          "--set", "ray.num_gpus_per_model_actor=1"], 2, "llm.tensor_parallel_size=4"),
    ("run-data-path-dir", ["run", "{demo}", "--set", "data.path={dir}"], 2, "data.path"),
    ("run-data-path-missing", ["run", "{demo}", "--set", "data.path={nope}"], 2, "no such file"),
    ("run-output-dir-file", ["run", "{demo}", "--set", "output_dir={file}"], 2, "not a directory"),
    ("run-output-dir-users-files", ["run", "{demo}", "--set", "output_dir={notbank}", "--no-ray"], 2,
     "not created by memgas"),
    ("run-api-key-pasted", ["run", "{demo}", "--set", "llm.api_key_env=sk-proj-0123456789abcdef"], 2,
     "not the name of an environment variable"),
    ("run-output-dir-under-file", ["run", "{demo}", "--set", "output_dir={file}/run"], 2, "is a file"),
    ("profile-bad-set", ["profile", "{demo}", "--set", "encoder.batch_size=0"], 2, "encoder.batch_size"),
]

#: rows that need a user without root's powers (root writes into read-only directories)
NONROOT_CASES: list[tuple[str, list[str], int, str]] = [
    ("run-output-dir-read-only", ["run", "{demo}", "--set", "output_dir={readonly}/run"], 3, "permission denied"),
    ("ingest-out-read-only", ["ingest", "{sample}", "--out", "{readonly}/bank"], 3, "Permission denied"),
]


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file below ``path``, and the directories: a changed bank shows here."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.name == LOCK:  # the lock file records its last holder (ingest takes the bank's lock): not data
            continue
        st = p.stat()
        out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad_args")
    bank = d / "bank"
    ingest(SAMPLE3, "longmemeval", bank, progress=False)
    run = d / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"run": {"name": "r"}, "dataset": {"sha256": "ab"}}))
    (d / "badrun").mkdir()
    (d / "badrun" / "metrics.json").write_text('{"run": ')
    (d / "listrun").mkdir()
    (d / "listrun" / "metrics.json").write_text("[1, 2]")
    (d / "badbank").mkdir()
    (d / "badbank" / "manifest.json").write_text("{oops")
    (d / "dir").mkdir()
    (d / "notbank").mkdir()
    (d / "notbank" / "mine.txt").write_text("keep me")
    (d / "file.txt").write_text("just text\n")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (d / "bad.yaml").write_text("retrieval: [\n")
    (d / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "deep.jsonl").write_text('{"history_id": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (d / "dupkey.json").write_text('[{"sample_id": "x", "conversation": {"session_1": [], "session_1": []}}]')
    (d / "bignum.json").write_text('[{"question_id": ' + "9" * 5000 + "}]")
    raw = SAMPLE3.read_bytes()
    (d / "truncated.json").write_bytes(raw[: len(raw) * 2 // 3])
    shutil.copy(REPO / "tests" / "pipeline" / "data" / "fixtures" / "lme_repeated_id_other_content.json", d / "conflict.json")
    ro = d / "readonly"
    ro.mkdir()
    ro.chmod(0o555)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    w = {
        "bank": str(bank), "run": str(run), "badrun": str(d / "badrun"), "listrun": str(d / "listrun"),
        "badbank": str(d / "badbank"), "dir": str(d / "dir"), "notbank": str(d / "notbank"),
        "file": str(d / "file.txt"), "binary": str(d / "binary.bin"), "badyaml": str(d / "bad.yaml"),
        "deep": str(d / "deep.json"), "deepl": str(d / "deep.jsonl"), "bignum": str(d / "bignum.json"), "dupkey": str(d / "dupkey.json"),
        "truncated": str(d / "truncated.json"), "conflict": str(d / "conflict.json"), "readonly": str(ro),
        "nope": str(d / "does-not-exist"), "new": str(d / "new-output"), "sample": str(SAMPLE3), "demo": str(DEMO),
        "busy_port": str(sock.getsockname()[1]), "_root": str(d),
    }
    yield w
    sock.close()
    ro.chmod(0o755)


def _check(world: dict[str, str], args: list[str], code: int, needle: str) -> None:
    argv = [a.format(**world) for a in args]
    watched = {k: _tree(Path(world[k])) for k in ("bank", "run", "notbank", "dir")}
    proc = run_memgas(*argv, timeout=120, check=False)
    lines = proc.stderr.splitlines()
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}: {proc.stderr[-1500:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{proc.stderr[-1500:]}"
    assert lines[0].startswith(f"memgas{' ' + argv[0] if not argv[0].startswith('-') and argv[0] != 'bogus' else ''}"), lines[0]
    assert "error" in lines[0] and needle.lower() in lines[0].lower(), lines[0]
    for k, before in watched.items():
        assert _tree(Path(world[k])) == before, f"{k} changed"
    assert not Path(world["new"]).exists(), "a failed command created its output"


@pytest.mark.parametrize("args, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument(world: dict[str, str], args: list[str], code: int, needle: str) -> None:
    _check(world, args, code, needle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("args, code, needle", [c[1:] for c in NONROOT_CASES], ids=[c[0] for c in NONROOT_CASES])
def test_bad_environment(world: dict[str, str], args: list[str], code: int, needle: str) -> None:
    _check(world, args, code, needle)


def test_every_command_has_a_row() -> None:
    commands = {c[1][0] for c in CASES}
    assert {"ingest", "stats", "synth", "report", "serve", "index", "answer", "run", "profile"} <= commands

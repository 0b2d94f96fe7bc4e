"""Bad input is one line with the right exit code, called in-process through
``memgas.jobs.cli.main`` (fast: no model loads, no Ray starts), except where the case needs a process of
its own (a file-size limit, SIGTERM with Ray). docs/reliability.md lists each case.

Each row: (id, args, exit code, words the one error line must hold). Args may name the files prepared
below in braces ({bank}, {fifo}, ...).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memgas.jobs import cli
from memgas.pipeline import faults
from memgas.pipeline.config import MAX_CONFIG_BYTES
from memgas.pipeline.ingest import ingest

REPO = Path(__file__).resolve().parents[2]
SAMPLE3 = REPO / "data" / "sample" / "longmemeval_s_sample3.json"
DEMO = REPO / "configs" / "demo.yaml"
BIG = "12345678901234567890"  # 20 digits: more than a C int64 holds

_JSONL_HISTORY = {"history_id": "u1", "sessions": [{"session_id": "s1", "turns": [
    {"role": "user", "content": "I moved to Oslo."}, {"role": "assistant", "content": "Nice!"}]}]}

CASES: list[tuple[str, list[str], int, str]] = [
    # 1. duplicate keys
    ("config-duplicate-section", ["index", "{bank}", "--config", "{dupyaml}"], 2,
     "dup.yaml: duplicate key 'retrieval' on line 3 (first on line 1)"),
    ("config-duplicate-nested-key", ["index", "{bank}", "--config", "{dupnested}"], 2, "duplicate key 'temp' on line 3"),
    ("set-duplicate-key", ["index", "{bank}", "--set", "retrieval={{temp: 0.1, temp: 0.3}}"], 2, "duplicate key 'temp'"),
    ("jsonl-duplicate-key", ["ingest", "{dupjsonl}", "--out", "{new}"], 2, "line 1: duplicate key 'history_id'"),
    # 2. regular files only, configs size-bounded
    ("config-fifo", ["index", "{bank}", "--config", "{fifo}"], 2, "not a regular file (a FIFO)"),
    ("config-dev-zero", ["serve", "--config", "/dev/zero"], 2, "not a regular file (a character device)"),
    ("config-too-big", ["index", "{bank}", "--config", "{bigyaml}"], 2, f"larger than a config can be ({MAX_CONFIG_BYTES} bytes)"),
    ("ingest-fifo", ["ingest", "{fifo}", "--format", "locomo", "--out", "{new}"], 2, "not a regular file"),
    ("ingest-dev-zero", ["ingest", "/dev/zero", "--format", "locomo", "--out", "{new}"], 2, "not a regular file"),
    ("run-data-path-fifo", ["run", "{demo}", "--set", "data.path={fifo}", "--set", "output_dir={new}"], 2,
     "data.path: {fifo}: not a regular file"),
    # index compares the config's data file with the bank's: a FIFO there must not block it
    ("index-config-data-fifo", ["index", "{emptybank}", "--set", "data.path={fifo}"], 2, "has no sessions"),
    # 4. values that ended as "a bug"
    ("jsonl-lone-surrogate", ["ingest", "{surrogate}", "--out", "{new}"], 2, "line 1: a lone UTF-16 surrogate"),
    ("encoder-max-tokens-2", ["index", "{bank}", "--set", "encoder.max_tokens=2"], 2,
     "encoder.max_tokens: Input should be greater than or equal to 8 (got 2)"),
    ("ks-20-digits", ["answer", "{bank}", "--set", f"evaluation.ks=[1,{BIG}]"], 2,
     "evaluation.ks[1]: Input should be less than or equal to 1000000"),
    ("store-top-20-digits", ["answer", "{bank}", "--set", f"retrieval.store_top={BIG}"], 2, "retrieval.store_top"),
    ("seed-20-digits", ["index", "{bank}", "--set", f"seed={BIG}"], 2, "seed: Input should be less than or equal to 4294967295"),
    ("temp-infinite", ["answer", "{bank}", "--set", "retrieval.temp=.inf"], 2, "retrieval.temp: Input should be a finite number"),
    ("timeout-nan", ["answer", "{bank}", "--set", "llm.timeout_s=.nan"], 2, "llm.timeout_s: Input should be a finite number"),
    ("report-sha256-a-number", ["report", "{shanum}"], 2, "dataset.sha256 should be a string, got a number"),
    ("report-compare-sha256-a-number", ["report", "{shanum}", "{shanum}"], 2, "dataset.sha256 should be a string"),
    ("report-notes-a-number", ["report", "{notesnum}"], 2, "qa.memgas.notes should be an array of strings"),
    ("report-record-stage-a-number", ["report", "{recordnum}"], 2, "record[0].stage should be a string, got a number"),
    # 5.
    ("address-port-too-big", ["index", "{bank}", "--address", "127.0.0.1:70000"], 2, "expected host:port (port 1-65535)"),
    ("address-port-zero", ["index", "{bank}", "--address", "127.0.0.1:0"], 2, "expected host:port (port 1-65535)"),
    ("run-no-questions", ["run", "{demo}", "--set", "data.path={emptyjson}", "--set", "data.format=longmemeval",
                          "--set", "output_dir={new}", "--no-ray"], 2, "has no questions; nothing to answer or evaluate"),
    ("run-limit-zero", ["run", "{demo}", "--set", "data.limit=0", "--set", "output_dir={new}", "--no-ray"], 2,
     "with limit 0 (in bank {new}/bank) has no questions"),
    ("index-no-sessions", ["index", "{emptybank}"], 2, "has no sessions; nothing to index"),
    ("answer-no-questions", ["answer", "{noqbank}", "--out", "{new}"], 2, "has no questions"),
    ("synth-turns-1e9", ["synth", "{new}", "--turns", "1000000000"], 2, "--turns: must be <= 10,000"),
    ("synth-sessions-too-many", ["synth", "{new}", "--sessions", "100000000"], 2, "--sessions: must be <= 1,000,000"),
    ("synth-utterances-per-history", ["synth", "{new}", "--sessions", "1000", "--turns", "10000"], 2,
     "= 10,000,000 utterances per history; at most 1,000,000"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("exit_codes")
    bank = d / "bank"
    ingest(SAMPLE3, "longmemeval", bank, progress=False)
    (d / "dup.yaml").write_text("retrieval:\n  num_seeds: 5\nretrieval:\n  temp: 0.3\n")
    (d / "dupnested.yaml").write_text("retrieval:\n  temp: 0.1\n  temp: 0.3\n")
    (d / "big.yaml").write_text("# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    os.mkfifo(d / "fifo")
    (d / "dup.jsonl").write_text('{"history_id": "a", "history_id": "b", "sessions": []}\n')
    line = json.dumps(_JSONL_HISTORY).replace("Oslo", "Oslo \\ud800")
    assert "\\ud800" in line
    (d / "surrogate.jsonl").write_text(line + "\n")
    (d / "empty.json").write_text("[]")
    ingest(d / "empty.json", "longmemeval", d / "emptybank", progress=False)
    (d / "noq.jsonl").write_text(json.dumps(_JSONL_HISTORY) + "\n")
    ingest(d / "noq.jsonl", "jsonl", d / "noqbank", progress=False)
    for name, metrics in (("shanum", {"dataset": {"sha256": 5}}), ("notesnum", {"qa": {"memgas": {"notes": 5}}}),
                          ("recordnum", {"record": [{"stage": 5}]})):
        (d / name).mkdir()
        (d / name / "metrics.json").write_text(json.dumps(metrics))
    return {
        "bank": str(bank), "dupyaml": str(d / "dup.yaml"), "dupnested": str(d / "dupnested.yaml"),
        "bigyaml": str(d / "big.yaml"), "fifo": str(d / "fifo"), "dupjsonl": str(d / "dup.jsonl"),
        "surrogate": str(d / "surrogate.jsonl"), "emptyjson": str(d / "empty.json"),
        "emptybank": str(d / "emptybank"), "noqbank": str(d / "noqbank"), "shanum": str(d / "shanum"),
        "notesnum": str(d / "notesnum"), "recordnum": str(d / "recordnum"), "demo": str(DEMO), "new": str(d / "new"),
    }


@pytest.mark.parametrize("args, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_its_exit_code(world, tmp_path, capsys, monkeypatch, args, code, needle) -> None:
    monkeypatch.chdir(REPO)
    world = {**world, "new": str(tmp_path / "new")}  # each case's own output path
    argv = [a.format(**world) for a in args]
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors exit from parse_args (still one line, exit 2)
        rc = exc.code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"memgas {argv[0]}: error: "), lines[0]
    assert needle.format(**world) in lines[0], lines[0]
    assert "Traceback" not in err
    if argv[0] in ("ingest", "synth", "answer"):
        assert not Path(world["new"]).exists(), "a refused command created its output"


def test_a_yaml_merge_key_is_not_a_duplicate(tmp_path) -> None:
    """`<<: *base` followed by a key of the base overrides it: that is what merges are for, not a repeat."""
    from memgas.pipeline.config import _read_yaml

    p = tmp_path / "merge.yaml"
    p.write_text("x-base: &b\n  num_seeds: 5\n  temp: 0.1\nretrieval:\n  <<: *b\n  temp: 0.3\n")
    assert _read_yaml(p)["retrieval"] == {"num_seeds": 5, "temp": 0.3}


def test_a_valid_surrogate_pair_is_kept(tmp_path) -> None:
    from memgas.pipeline.bank import Bank

    line = json.dumps(_JSONL_HISTORY).replace("Oslo", "Oslo \\ud83d\\ude00")
    (tmp_path / "pair.jsonl").write_text(line + "\n")
    ingest(tmp_path / "pair.jsonl", "jsonl", tmp_path / "bank", progress=False)
    texts = Bank(tmp_path / "bank").read("texts", ["text"]).column("text").to_pylist()
    assert any("Oslo \U0001F600" in t for t in texts), texts


def test_a_file_size_limit_is_the_environment(tmp_path) -> None:
    """EFBIG (``ulimit -f``) is exit 3 like a full disk; Python ignores SIGXFSZ, so the write fails with it."""
    limit = 64 * 1024

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    exe = Path(sys.executable).with_name("memgas")
    proc = subprocess.run([str(exe), "synth", str(tmp_path / "s.json"), "--questions", "50"], capture_output=True,
                          text=True, timeout=120, preexec_fn=small_files, cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 3, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("memgas synth: error: File too large"), proc.stderr
    assert "ulimit -f" in lines[0]
    assert not (tmp_path / "s.json").exists() and not list(tmp_path.glob(".s.json*"))


def test_sigterm_is_handled_like_ctrl_c(tmp_path, capsys, monkeypatch) -> None:
    """A real SIGTERM (sent by the fault hook at a named point) during the first ingest into a new bank:
    one line, exit 143, the half-written bank removed as after Ctrl-C; the caller's handler comes back."""
    monkeypatch.setenv("MEMGAS_FAULT", "term@ingest:after-part")
    monkeypatch.setattr(faults, "_counts", {})
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "bank"
    rc = cli.main(["ingest", str(SAMPLE3), "--format", "longmemeval", "--out", str(out)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 143
    assert err == [f"memgas ingest: terminated (SIGTERM): interrupted before the new data was committed: {out} "
                   "is unchanged"]
    assert not out.exists()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_sigterm_with_ray_is_one_line_exit_143_and_resumable(tmp_path, memgas_exe) -> None:
    """`memgas run` with a local Ray (whose ray.init installs its own SIGTERM handler) gets SIGTERM between
    generate's last unit and its marker: one line, exit 143, no Ray stack dump; the next run resumes. The
    resume runs in-process (--no-ray): what this test checks is the bank the SIGTERM left, and a second local
    Ray would only add its start-up (the Ray path's own resume: tests/jobs/test_resume.py)."""
    exe, env, repo = memgas_exe
    args = [exe, "run", "configs/demo.yaml", "--set", f"output_dir={tmp_path / 'run'}", "--set", "data.limit=1",
            "--set", "data.path=tests/fixtures/locomo_small.json", "--set", "reading.enabled=false",
            "--set", "retrieval.methods=[session,memgas]", "--set", "evaluation.plots=false", "-q"]
    proc = subprocess.run(args, cwd=repo, env={**env, "MEMGAS_FAULT": "term@runner:before-marker:generate"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("memgas run: terminated (SIGTERM): interrupted; completed units are "
                                            "kept, re-run to resume"), proc.stderr[-3000:]
    marker = json.loads((tmp_path / "run" / "RUNNING.json").read_text())
    assert marker["status"] == "failed" and marker["error"].startswith("Terminated")
    again = subprocess.run([*args[:-1], "--no-ray"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())["record"]
    by_stage = {r["stage"]: r for r in record}
    # the summaries written before the SIGTERM were kept (generate plans only what is missing: nothing),
    # and the stages it never reached ran now
    assert by_stage["generate"]["units_done"] == 0 and by_stage["generate"]["status"] != "skipped", by_stage["generate"]
    assert by_stage["encode"]["units_done"] > 0, by_stage["encode"]


def test_a_unit_that_fails_from_a_bug_says_so_instead_of_advising_a_re_run(capsys: pytest.CaptureFixture,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A task's own exception (Ray hands it back inside a RayTaskError) was "unit ... failed ... Completed
    units are kept; re-run to resume" (exit 2), and the re-run failed the same way. The executor's error for a
    failed unit, printed by the command line: a bug is exit 1 and says "a bug"; an I/O failure in the task and
    a crashed worker still advise the re-run (exit 2). Real Ray exception objects, no cluster started."""
    from ray.exceptions import RayTaskError, WorkerCrashedError

    from memgas.jobs.executor import _failed
    from memgas.jobs.stages import PIPELINE

    stage = next(s for s in PIPELINE if s.name == "rank")
    unit = {"part": "rank-0001"}

    def as_cli(exc: BaseException) -> tuple[int, str]:
        def raise_it(args: object) -> int:  # the command's work: a unit that failed with ``exc``
            raise _failed(stage, unit, exc) from exc
        monkeypatch.setattr(cli, "_dispatch", raise_it)
        rc = cli.main(["stats", "x"])
        return rc, capsys.readouterr().err.strip()

    def task_error(cause: BaseException) -> BaseException:
        return RayTaskError("run_task", f"Traceback ...\n{cause!r}", cause).as_instanceof_cause()

    assert as_cli(task_error(ValueError("year -4977 is out of range"))) == (1, (
        "memgas stats: error: rank: unit rank-0001 failed from a bug: ValueError: year -4977 is out of range "
        "(a re-run fails the same way; re-run with -v for the traceback)"))
    rc, line = as_cli(task_error(OSError(5, "Input/output error")))
    assert rc == 2 and line.endswith("Completed units are kept; re-run to resume."), line
    rc, line = as_cli(WorkerCrashedError())
    assert rc == 2 and line.startswith("memgas stats: error: rank: unit rank-0001 failed: WorkerCrashedError") \
        and line.endswith("re-run to resume."), line


def test_answer_takes_the_banks_lock_for_the_whole_answer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An append during `answer`, or `answer` during `index`, ended the answer with exit 2 "stage 'generate'
    was not run with this config": answer read the bank without its lock. It holds a reader's lock from
    start to end: held by a writer, the answer is refused naming it; while a reader holds it, a writer (an
    append here) is refused and the bank is unchanged."""
    from memgas.pipeline.locks import LOCK, locked

    bank = tmp_path / "bank"
    ingest(SAMPLE3, "longmemeval", bank, progress=False)
    with locked(bank):  # a writer: `memgas index` or an append
        holder = (bank / LOCK).read_text()
        rc = cli.main(["answer", str(bank), "--config", str(DEMO), "--no-ray", "--out", str(tmp_path / "run")])
    assert holder.startswith(f"pid {os.getpid()} on ")
    assert (rc, capsys.readouterr().err.strip()) == (2, f"memgas answer: error: {bank} is in use by {holder}; wait "
                                                        "for it to finish or use another directory")
    before = {f: f.read_bytes() for f in bank.rglob("*.*") if f.name != LOCK}
    with locked(bank, shared=True), locked(bank, shared=True):  # two answers read it at once
        rc = cli.main(["ingest", str(SAMPLE3), "--format", "longmemeval", "--append", "--out", str(bank)])
    assert (rc, capsys.readouterr().err.strip()) == (2, (
        f"memgas ingest: error: {bank} is in use by another memgas process (an answer reading it, or one starting); "
        "wait for it to finish or use another directory"))
    assert {f: f.read_bytes() for f in bank.rglob("*.*") if f.name != LOCK} == before


def test_ray_under_a_small_address_space_limit_is_one_line_exit_3(tmp_path: Path) -> None:
    """`ulimit -v` too small for Ray: its start waited ~35 s and failed with exit 1 and Ray's stack. Now
    one line naming the limit, exit 3, before Ray starts."""
    bank = tmp_path / "bank"
    ingest(SAMPLE3, "longmemeval", bank, progress=False)
    limit = 3 << 30

    def small() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = subprocess.run([sys.executable, "-m", "memgas", "index", str(bank), "--config", str(DEMO), "-q"],
                       capture_output=True, text=True, timeout=300, preexec_fn=small)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert (p.returncode, p.stderr.strip().splitlines()[-1]) == (3, (
        "memgas index: error: Ray cannot start under this process's address-space limit of 3072 MiB (`ulimit -v`): "
        "raise it (`ulimit -v unlimited`) or run with --no-ray"))

"""Locks before the first write, and only ever touch what is yours.

Lock races use real processes: a holder process takes the very lock memgas takes (``memgas.pipeline.locks``)
and the command under test runs in-process through ``cli.main``; one case races two real `memgas ingest`
processes. Every refusal is one line, exit 2, and leaves the other party's files byte for byte as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memgas.jobs import cli, run_dir
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import MemgasError
from memgas.pipeline.locks import LOCK

from .conftest import REPO, SAMPLE_LOCOMO, memgas_env

SMALL_LOCOMO_FILE = REPO / "tests" / "fixtures" / "locomo_small.json"
SMALL = ["--no-ray", "-q", "--set", "data.limit=1", "--set", "reading.enabled=false", "--set",
         "retrieval.methods=[session,memgas]"]

# Holds DIR's lock (after ingesting the sample into it with the lock held, when asked) until stdin closes.
HOLDER = """
import sys
from pathlib import Path
from memgas.pipeline.ingest import ingest
from memgas.pipeline.locks import locked
bank = Path(sys.argv[1])
with locked(bank):
    if sys.argv[2] == "ingest":
        ingest(sys.argv[3], "locomo", bank, limit=1, progress=False, lock=False)
    print("held", flush=True)
    sys.stdin.read()
"""


class Holder:
    """A real process holding a directory's memgas lock until :meth:`release`."""

    def __init__(self, directory: Path, *, ingest: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), "ingest" if ingest else "-",
                                      str(SAMPLE_LOCOMO)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=memgas_env(), cwd=REPO)
        line = self.proc.stdout.readline()
        assert line == "held\n", f"the holder did not take the lock: {line!r}, rc={self.proc.poll()}"

    def release(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(timeout=60)


def snapshot(d: Path) -> dict[str, str]:
    """Every file under ``d`` (the lock file excepted: its text names the holder) -> sha256 of its bytes."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != LOCK}


def main(capsys, *argv: str) -> tuple[int, str]:
    """``memgas ARGV`` in-process: (exit code, stderr)."""
    capsys.readouterr()
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def run_args(out: Path, *extra: str) -> list[str]:
    return ["run", "configs/demo.yaml", "--set", f"output_dir={out}", *SMALL, *extra]


# -- locks ---------------------------------------------------------------------------------------------------
def test_ingest_into_a_bank_being_ingested_is_refused_and_leaves_it_intact(tmp_path, capsys) -> None:
    """The holder creates the bank and ingests into it under the lock; a second ingest into the same new
    bank must say "in use" before its first write, and never clean up (delete) the holder's bank."""
    bank = tmp_path / "bank"
    holder = Holder(bank, ingest=True)
    try:
        before = snapshot(bank)
        assert "manifest.json" in before
        rc, err = main(capsys, "ingest", str(SAMPLE_LOCOMO), "--format", "locomo", "--out", str(bank), "--limit", "2")
        line = one_line(err)
        assert rc == 2 and "in use by pid" in line and str(holder.proc.pid) in line, line
        assert snapshot(bank) == before
    finally:
        assert holder.release() == 0
    assert snapshot(bank) == before
    assert Bank(bank).ingest_complete() and Bank(bank).count("histories") == 1


def test_two_concurrent_ingests_into_one_new_bank_leave_one_intact_bank(tmp_path) -> None:
    """Two real `memgas ingest` processes into one new bank: each either ingests (0) or says "in use" (2);
    whatever the interleaving, the bank at the end is complete (the loser never removes the winner's)."""
    bank = tmp_path / "new" / "bank"
    exe = str(Path(sys.executable).with_name("memgas"))
    procs = [subprocess.Popen([exe, "ingest", str(SAMPLE_LOCOMO), "--format", "locomo", "--out", str(bank), "-q"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=memgas_env(), cwd=REPO)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert 0 in [rc for rc, _ in results], results
    for rc, err in results:
        # "in use by pid N ..." or, caught between the flock and the holder writing its pid, "by another process"
        assert rc == 0 or (rc == 2 and " is in use by " in one_line(err)), results
    b = Bank(bank)
    assert b.ingest_complete() and b.count("histories") == 2 and b.count("queries") > 0


def test_a_second_run_sharing_a_bank_says_in_use_before_it_writes(tmp_path, capsys) -> None:
    """A run whose bank_dir is held by another process (as a first run would hold it while encoding) is
    refused before it looks at the bank: before the fix it re-ingested (here: another data.limit) first."""
    bank = tmp_path / "shared_bank"
    rc, _ = main(capsys, "ingest", str(SAMPLE_LOCOMO), "--format", "locomo", "--out", str(bank), "--limit", "1", "-q")
    assert rc == 0
    before = snapshot(bank)
    holder = Holder(bank)
    try:
        rc, err = main(capsys, *run_args(tmp_path / "second", "--set", f"bank_dir={bank}", "--set", "data.limit=2"))
        line = one_line(err)
        assert rc == 2 and "in use by pid" in line and str(holder.proc.pid) in line, line
        assert snapshot(bank) == before
    finally:
        assert holder.release() == 0
    assert json.loads((tmp_path / "second" / "RUNNING.json").read_text())["status"] == "failed"


# -- ownership -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["config.yaml", "report.md"])
def test_a_run_refuses_a_directory_holding_the_users_files(tmp_path, capsys, name) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text("my own notes\n")
    for fresh in ([], ["--fresh"]):
        rc, err = main(capsys, *run_args(out), *fresh)
        line = one_line(err)
        assert rc == 2 and "was not created by memgas" in line and name in line, line
        assert sorted(p.name for p in out.iterdir()) == [name]
        assert (out / name).read_text() == "my own notes\n"


def test_a_failed_run_left_by_an_older_memgas_does_not_make_a_directory_memgas_s(tmp_path, capsys) -> None:
    """An older memgas wrote RUNNING.json into any directory it ran in; --fresh then deleted the user's
    files. RUNNING.json is no proof of ownership: refused, nothing touched."""
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "RUNNING.json").write_text(json.dumps({"status": "failed", "config": {}}))
    rc, err = main(capsys, *run_args(out), "--fresh")
    assert rc == 2 and "refusing to delete it" in one_line(err)
    assert sorted(p.name for p in out.iterdir()) == ["RUNNING.json", "thesis.tex"]
    assert (out / "thesis.tex").read_text() == "years of work"


def test_fresh_never_deletes_the_dataset_beside_it(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    data.mkdir()
    dataset = data / "locomo.json"
    dataset.write_bytes(SAMPLE_LOCOMO.read_bytes())
    rc, err = main(capsys, *run_args(data, "--set", f"data.path={dataset}"), "--fresh")
    assert rc == 2 and "refusing to delete it" in one_line(err)
    assert sorted(p.name for p in data.iterdir()) == ["locomo.json"]
    assert dataset.read_bytes() == SAMPLE_LOCOMO.read_bytes()


def test_bank_dir_equal_to_output_dir_is_refused(tmp_path, capsys) -> None:
    out = tmp_path / "r"
    rc, err = main(capsys, *run_args(out, "--set", f"bank_dir={out}"))
    assert rc == 2 and "bank_dir and output_dir" in one_line(err)
    assert not out.exists()


def test_the_split_flow_writes_its_run_beside_its_own_bank(tmp_path, capsys) -> None:
    """ingest/index into output_dir/bank, then answer into output_dir: the bank is the command's own, so
    the directory may be claimed (the marker records the bank); a non-bank directory by that name may not."""
    out = tmp_path / "run"
    rc, _ = main(capsys, "ingest", str(SAMPLE_LOCOMO), "--format", "locomo", "--out", str(out / "bank"), "--limit", "1")
    assert rc == 0
    run_dir.check_output_dir(out, fresh=False, bank_dir=out / "bank")
    assert run_dir.claim_run_dir(out, out / "bank")["entries"] == ["bank"]
    other = tmp_path / "other"
    (other / "bank").mkdir(parents=True)
    with pytest.raises(MemgasError, match=r"is not empty \(bank\) and was not created by memgas"):
        run_dir.check_output_dir(other, fresh=False, bank_dir=other / "bank")


def test_fresh_removes_what_memgas_wrote_and_nothing_else(tmp_path) -> None:
    """The run directory's own files (listed in RUN_FILES, and the bank the marker records) go; a user's
    file dropped into the run directory, and a bank memgas did not record, stay."""
    out = tmp_path / "run"
    out.mkdir()
    run_dir.claim_run_dir(out)
    run_dir.record_own_bank(out, out / "bank")
    for name in run_dir.RUN_FILES:
        if name == "results":
            (out / name / "t").mkdir(parents=True)
        else:
            (out / name).write_text("memgas")
    (out / ".metrics.json.abc123.tmp").write_text("half")
    (out / "bank" / "sessions").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "other_bank").mkdir()
    (out / "other_bank" / "manifest.json").write_text("{}")
    run_dir.empty_run_dir(out)
    assert sorted(p.name for p in out.iterdir()) == [run_dir.OWNER, "notes.txt", "other_bank"]
    assert json.loads((out / run_dir.OWNER).read_text())["entries"] == ["bank"]


def test_a_run_fresh_rerun_keeps_the_users_file_in_its_directory(tmp_path, monkeypatch, capsys) -> None:
    """End to end: a run creates its directory (OWNER marker at creation) at ``~/run``, expanded (it used
    to be created as ./~/run and read from $HOME/run); a file the user adds there survives --fresh."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    demo = str(REPO / "configs" / "demo.yaml")
    out = home / "run"
    small = ["--set", f"data.path={SMALL_LOCOMO_FILE}"]  # two whole runs: the smallest file that runs every stage
    rc, err = main(capsys, "run", demo, "--set", "output_dir=~/run", *SMALL, *small)
    assert rc == 0, err
    assert os.listdir(cwd) == []
    marker = json.loads((out / run_dir.OWNER).read_text())
    assert marker["entries"] == ["bank"]
    (out / "notes.txt").write_text("mine")
    rc, err = main(capsys, "run", demo, "--set", "output_dir=~/run", *SMALL, *small, "--fresh")
    assert rc == 0, err
    assert (out / "notes.txt").read_text() == "mine"
    record = {r["stage"]: r["status"] for r in json.loads((out / "run_record.json").read_text())}
    assert record["ingest"] == "executed"  # --fresh removed the bank it had created: ingested again
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [LOCK, run_dir.OWNER, "notes.txt", "bank", "config.yaml", "manifest.json", "metrics.json", "report.md",
         "results", "run_record.json", "recall_at_k.png", "recall_by_type.png", "stage_times.png"])
    assert os.listdir(cwd) == []


def test_report_out_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    metrics = {"run": {"name": "x"}, "dataset": {"sha256": "ab"}, "retrieval": {"session": {}}}
    (run / "metrics.json").write_text(json.dumps(metrics))
    own = (run / "metrics.json").read_bytes()
    for target in (run / "metrics.json", tmp_path / "essay.md"):
        if target.name == "essay.md":
            target.write_text("# my essay\n")
        before = target.read_bytes()
        rc, err = main(capsys, "report", str(run), str(run), "--out", str(target))
        line = one_line(err)
        assert rc == 2 and "refusing to overwrite" in line, line
        assert target.read_bytes() == before
    assert (run / "metrics.json").read_bytes() == own
    cmp = tmp_path / "cmp.md"
    for _ in range(2):  # a new file, then the comparison it wrote: replaced
        rc, err = main(capsys, "report", str(run), str(run), "--out", str(cmp))
        assert rc == 0, err
        assert cmp.read_text().startswith("# memgas run comparison\n")


def test_home_in_path_fields_is_expanded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = MemgasConfig.load(None, ["output_dir=~/runs/x", "bank_dir=~/banks/b", "data.path=~/d.json",
                                   "encoder.model=~/models/enc", "llm.model=~/models/llm.gguf"])
    assert cfg.output_dir == f"{tmp_path}/runs/x"
    assert cfg.bank_path == tmp_path / "banks" / "b"
    assert cfg.data.path == f"{tmp_path}/d.json"
    assert (cfg.encoder.model, cfg.llm.model) == (f"{tmp_path}/models/enc", f"{tmp_path}/models/llm.gguf")
    assert MemgasConfig.load(None, ["encoder.model=minilm"]).encoder.model == "minilm"  # names stay names

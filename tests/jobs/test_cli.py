"""The command line as a user meets it: --help everywhere, one-line errors, ingest + stats.

``cli`` runs `memgas` in-process (tests/jobs/conftest.py); the installed console script as a real process is
smoke-tested by the ingest + stats journey and the internal-error and disk-full exits below."""

from __future__ import annotations

import json

import pytest
from tests.conftest import SAMPLE_COUNTS


COMMANDS = ["ingest", "stats", "synth", "index", "answer", "run", "profile", "report", "serve"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(cli, command: str) -> None:
    proc = cli(command, "--help")
    assert "usage: memgas " + command in proc.stdout
    assert "xample" in proc.stdout, f"{command} --help shows no example"


def test_top_level_help_lists_commands(cli) -> None:
    out = cli("--help").stdout
    for c in COMMANDS:  # each command on its own line with a description after its name
        line = next((ln for ln in out.splitlines() if ln.strip().startswith(c + " ")), None)
        assert line is not None and len(line.split(c, 1)[1].strip()) > 10, f"{c} has no description in --help"


def test_ingest_and_stats_on_the_bundled_sample(cli_process, tmp_path, sample_locomo) -> None:
    cli = cli_process  # a real process: the console script end to end
    bank = tmp_path / "bank"
    out = cli("-q", "ingest", str(sample_locomo), "--format", "locomo", "--out", str(bank)).stdout
    assert f"histories={SAMPLE_COUNTS['histories']}" in out and f"sessions={SAMPLE_COUNTS['sessions']}" in out
    stats = json.loads(cli("stats", str(bank), "--json").stdout)
    assert stats["histories"] == 2
    assert stats["queries"] == SAMPLE_COUNTS["queries"]
    table = cli("stats", str(bank)).stdout
    assert "unique sessions" in table


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'[{"sample_id": "x", "conversation": ', "truncated"),
        (b'{"not": "a list"}', "expected a JSON array"),
        (b'[1, 2]', "record 0"),
        (b'\xff\xfe[]', "UTF-8"),
    ],
)
def test_bad_input_is_one_line_without_traceback(cli, tmp_path, content: bytes, needle: str) -> None:
    f = tmp_path / "bad.json"
    f.write_bytes(content)
    proc = cli("-q", "ingest", str(f), "--format", "locomo", "--out", str(tmp_path / "b"), check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("memgas ingest: error:")]
    assert len(errors) == 1, proc.stderr
    assert needle.lower() in errors[0].lower(), errors[0]


def test_bad_config_value_is_a_clear_error(cli, tmp_path) -> None:
    proc = cli("run", "configs/demo.yaml", "--set", "retrieval.num_seeds=lots", check=False)
    assert proc.returncode == 2
    assert "retrieval.num_seeds" in proc.stderr and "Traceback" not in proc.stderr


def test_stats_on_a_missing_bank(cli, tmp_path) -> None:
    proc = cli("stats", str(tmp_path / "nope"), check=False)
    assert proc.returncode == 2 and "not a memory bank" in proc.stderr


def test_internal_error_is_one_line_exit_1_and_traceback_with_v(memgas_exe, tmp_path, sample_locomo) -> None:
    import subprocess

    exe, env, repo = memgas_exe
    env = {**env, "MEMGAS_FAULT": "raise@bank:write-part:before-rename"}
    args = [exe, "ingest", str(sample_locomo), "--out", str(tmp_path / "b")]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "memgas ingest: error: internal error RuntimeError: injected failure at bank:write-part:before-rename "
        "(a bug; re-run with -v for the traceback)"]
    assert not (tmp_path / "b").exists()
    proc = subprocess.run([exe, "-v", *args[1:]], capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("memgas ingest: error: internal error RuntimeError")


def test_disk_full_is_exit_3(memgas_exe, tmp_path, sample_locomo) -> None:
    import subprocess

    exe, env, repo = memgas_exe
    env = {**env, "MEMGAS_FAULT": "enospc@bank:write-part:before-rename"}
    proc = subprocess.run([exe, "ingest", str(sample_locomo), "--out", str(tmp_path / "b")], capture_output=True,
                          text=True, env=env, cwd=repo, timeout=300)
    assert proc.returncode == 3
    assert proc.stderr.splitlines() == [
        "memgas ingest: error: No space left on device (injected at bank:write-part:before-rename) "
        "(free some space and re-run; completed work is kept)"]


def test_ingest_summary_counts_warnings_and_repeats(cli, tmp_path) -> None:
    f = tmp_path / "h.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    f.write_text(json.dumps({"history_id": "h", "sessions": [
        {"session_id": "a", "turns": turns}, {"session_id": "e", "turns": []}, {"session_id": "a", "turns": turns}],
        "questions": [{"query_id": "q", "question": "?"}]}) + "\n")
    out = cli("ingest", str(f), "--out", str(tmp_path / "b"), "-q").stdout
    assert "(jsonl)" in out and "repeated_sessions=1" in out
    assert "; 2 warnings (empty_session 1, repeated_session 1; see the log)" in out
    table = cli("stats", str(tmp_path / "b")).stdout
    assert "repeats dropped at ingest" in table and "ingest warnings" in table


def test_quiet_and_verbose_after_the_command(cli, tmp_path, sample_locomo) -> None:
    out = cli("ingest", str(sample_locomo), "--out", str(tmp_path / "b"), "-q")
    assert out.stderr == "" and "histories=2" in out.stdout
    assert json.loads(cli("ingest", str(sample_locomo), "--out", str(tmp_path / "b"), "-v", "-q").stdout)["histories"] == 2


def test_report_compares_and_flags_different_datasets(cli, tmp_path) -> None:
    for name, sha in (("a", "1" * 64), ("b", "2" * 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({
            "dataset": {"path": f"/data/{name}.json", "sha256": sha},
            "retrieval": {"session": {"memgas": {"overall": {"recall_all@5": 0.5}}}}}))
    out = cli("report", str(tmp_path / "a"), str(tmp_path / "b")).stdout
    assert "different datasets" in out and "a.json (sha256 111111111111)" in out and "| a | memgas |" in out

"""The command line as a user meets it: --help everywhere, one-line errors, ingest + stats."""

from __future__ import annotations

import json

import pytest


COMMANDS = ["ingest", "stats", "synth", "index", "answer", "run", "profile", "report", "serve"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(cli, command: str) -> None:
    proc = cli(command, "--help")
    assert "usage: memgas " + command in proc.stdout
    assert "xample" in proc.stdout, f"{command} --help shows no example"


def test_top_level_help_lists_commands(cli) -> None:
    out = cli("--help").stdout
    for c in COMMANDS:
        assert c in out


def test_ingest_and_stats_on_the_bundled_sample(cli, tmp_path, sample_locomo) -> None:
    bank = tmp_path / "bank"
    out = cli("-q", "ingest", str(sample_locomo), "--format", "locomo", "--out", str(bank)).stdout
    assert "histories=2" in out and "sessions=38" in out
    stats = json.loads(cli("stats", str(bank), "--json").stdout)
    assert stats["histories"] == 2
    assert stats["queries"] == 304
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

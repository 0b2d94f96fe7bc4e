"""Secrets and hostile text: no credential in any file of a run or on the terminal,
no API key accepted where an environment variable's name belongs, dataset strings inert in report.md and
on the terminal."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from memgas.jobs import cli
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.errors import ConfigError
from memgas.pipeline.redact import printable, redact

from .conftest import REPO, memgas_env

SMALL = ["--no-ray", "-q", "--set", "data.limit=1", "--set", "reading.enabled=false", "--set",
         "retrieval.methods=[session,memgas]", "--set", "evaluation.plots=false"]
PASSWORD = "s3cretPW"
URL = f"http://user:{PASSWORD}@127.0.0.1:9/v1"
SHOWN = "http://***@127.0.0.1:9/v1"
ESC = "\x1b"


def main(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``needle`` (Parquet, PNG and temp files included)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes())


# -- credentials -------------------------------------------------------------------------------------------
def test_redact() -> None:
    assert redact(URL) == SHOWN
    assert redact("http://TOKEN@host/v1 and https://a:b@c:443/x") == "http://***@host/v1 and https://***@c:443/x"
    assert redact("http://u:p@ss@h:1/v1?api_key=K1&x=1&token=T2") == "http://***@h:1/v1?api_key=***&x=1&token=***"
    assert redact("user@example.com wrote http://host:8000/v1") == "user@example.com wrote http://host:8000/v1"
    assert redact("data.path: http:/u:pw@host/x.json") == "data.path: http:/***@host/x.json"  # a URL through Path


def test_credentials_in_a_url_never_reach_a_file_of_the_run(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    rc, _, err = main(capsys, "run", "configs/demo.yaml", "--set", f"output_dir={out}", "--set", f"llm.base_url={URL}",
                      "--set", "ray.address=ray://admin:hunter2@127.0.0.1:1", *SMALL,
                      "--set", f"data.path={REPO / 'tests' / 'fixtures' / 'locomo_small.json'}")  # a whole run: the smallest file
    assert rc == 0, err
    assert files_holding(out, PASSWORD) == [] and files_holding(out, "hunter2") == []
    assert f"base_url: {SHOWN}\n" in (out / "config.yaml").read_text()
    assert json.loads((out / "manifest.json").read_text())["config"]["llm"]["base_url"] == SHOWN
    assert json.loads((out / "bank" / "manifest.json").read_text())["index"]["config"]["ray"]["address"] == \
        "ray://***@127.0.0.1:1"


def test_a_failing_run_shows_and_records_the_redacted_url_only(tmp_path) -> None:
    """A real process against a server that does not answer: its warning lines name the redacted URL, its
    error is one line, and RUNNING.json records the redacted config."""
    out = tmp_path / "run"
    exe = str(Path(sys.executable).with_name("memgas"))
    proc = subprocess.run([exe, "run", "configs/demo.yaml", "--set", f"output_dir={out}", *SMALL, "--set",
                           "generation.generator=llm", "--set", "llm.backend=openai", "--set", f"llm.base_url={URL}",
                           "--set", "llm.max_retries=0", "--set", "llm.timeout_s=2"],
                          capture_output=True, text=True, env=memgas_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert PASSWORD not in proc.stderr + proc.stdout
    assert f"{SHOWN}/chat/completions item 0 failed" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("memgas run: error: generate: ")
    marker = json.loads((out / "RUNNING.json").read_text())
    assert marker["status"] == "failed" and marker["config"]["llm"]["base_url"] == SHOWN
    assert files_holding(out, PASSWORD) == []


def test_an_error_quoting_a_url_prints_it_redacted(tmp_path, capsys) -> None:
    rc, _, err = main(capsys, "run", "configs/demo.yaml", "--set", f"output_dir={tmp_path / 'r'}", "--set",
                      f"data.path={URL}/data.json", *SMALL)
    # pathlib folds the "//" of a URL: the redaction knows that form too
    assert rc == 2 and err == "memgas run: error: data.path: http:/***@127.0.0.1:9/v1/data.json: no such file " \
        "(relative paths are looked up from the working directory, then from the config file's directory)\n"


@pytest.mark.parametrize("key", ["sk-proj-abc123DEF456ghi789", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567",
                                 "abcdefABCDEF0123456789abcdef", "Bearer abc"])
def test_a_key_pasted_into_api_key_env_is_refused_without_echoing_it(tmp_path, capsys, key) -> None:
    out = tmp_path / "r"
    rc, _, err = main(capsys, "run", "configs/demo.yaml", "--set", f"output_dir={out}", "--set",
                      f"llm.api_key_env={key}", *SMALL)
    assert rc == 2 and err.count("\n") == 1 and key not in err, err
    assert err.startswith("memgas run: error: --set llm.api_key_env=***: llm.api_key_env: this is not the name of "
                          "an environment variable") and "do not paste API keys into a config" in err
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"llm:\n  api_key_env: '{key}'\n")
    rc, _, err = main(capsys, "run", str(cfg), "--set", f"output_dir={out}", *SMALL)
    assert rc == 2 and key not in err and err.startswith(f"memgas run: error: {cfg}: llm.api_key_env: this is not")
    assert not out.exists()


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "HF_TOKEN", "MY_KEY_2", "my_key"])
def test_environment_variable_names_are_accepted(name) -> None:
    assert MemgasConfig.load(None, [f"llm.api_key_env={name}"]).llm.api_key_env == name


def test_a_pasted_key_in_a_config_object_is_refused() -> None:
    with pytest.raises(ConfigError, match="not the name of an environment variable"):
        MemgasConfig.load(None, ["llm.api_key_env=sk-live-0123456789"])


# -- hostile text --------------------------------------------------------------------------------------------
HOSTILE_TYPE = "a|b\n<script>alert(1)</script> [x](javascript:alert(1)) \x1b]52;c;ZXZpbA==\x07\x1b[2J"


def test_dataset_strings_in_report_md_are_escaped(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    metrics = {
        "run": {"name": "demo\n# injected heading", "encoder": "minilm"},
        "dataset": {"path": "/data/<img src=x onerror=alert(1)>.json", "sha256": "ab"},
        "retrieval": {"session": {"memgas": {"overall": {"recall_all@5": 0.5}, "n_evaluated": 2, "skipped": {},
                                             "by_type": {HOSTILE_TYPE: {"recall_all@5": 0.5, "n": 2}}}}},
    }
    (run / "metrics.json").write_text(json.dumps(metrics))
    rc, out, err = main(capsys, "report", str(run))
    assert rc == 0, err
    text = (run / "report.md").read_text()
    assert text.startswith("# memgas report: demo # injected heading\n")
    assert "- **dataset**: /data/&lt;img src=x onerror=alert(1)&gt;.json\n" in text
    cell = r"a\|b &lt;script&gt;alert(1)&lt;/script&gt; \[x\](javascript:alert(1))  \]52;c;ZXZpbA==  \[2J"
    assert f"| method | {cell} (n=2) |\n" in text
    assert ESC not in text and "<script>" not in text


def test_control_sequences_from_data_never_reach_the_terminal(tmp_path, capsys) -> None:
    data = tmp_path / "h.jsonl"
    data.write_text(json.dumps({
        "history_id": "u1",
        "sessions": [{"session_id": "s1", "turns": [{"role": "user", "content": "I moved to Oslo."}]}],
        "questions": [{"query_id": "q0", "question": "Where?", "answer": "Oslo", "question_type": HOSTILE_TYPE,
                       "evidence_session_ids": ["s1"]}],
    }) + "\n")
    bank = tmp_path / "bank"
    rc, _, err = main(capsys, "ingest", str(data), "--out", str(bank), "-q")
    assert rc == 0, err
    rc, out, err = main(capsys, "stats", str(bank))
    assert rc == 0 and ESC not in out + err and "\x07" not in out
    assert "\\x1b]52;c;ZXZpbA==\\x07\\x1b[2J" in out
    # an error line quoting a file name that holds an escape sequence
    evil = tmp_path / f"{ESC}[31mred.json"
    rc, out, err = main(capsys, "ingest", str(evil), "--out", str(tmp_path / "b2"))
    assert rc == 2 and ESC not in err and err == f"memgas ingest: error: {tmp_path}/\\x1b[31mred.json: no such file\n"


def test_log_lines_are_printable_and_redacted() -> None:
    """The formatter the CLI puts on its log handler (warnings from loaders and models go through it)."""
    fmt = cli._SafeFormatter("%(levelname)s %(message)s")
    record = logging.LogRecord("memgas", logging.WARNING, __file__, 1, "type %r at %s", (f"x{ESC}[2Jy\r", URL), None)
    assert fmt.format(record) == f"WARNING type 'x\\x1b[2Jy\\r' at {SHOWN}"
    record = logging.LogRecord("memgas", logging.WARNING, __file__, 1, "type %s", (f"x{ESC}[2Jy\rz\n",), None)
    assert fmt.format(record) == "WARNING type x\\x1b[2Jy\\x0dz\n"
    assert printable("tab\there\nnext \x9b31m") == "tab\there\nnext \\x9b31m"

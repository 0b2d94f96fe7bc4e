"""memgas ingest --append: sessions added to existing histories, new histories and questions, atomic,
idempotent, out-of-order sessions refused (or recorded for recomputation with --allow-reorder)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from memgas.pipeline.bank import INGEST_TABLES, Bank
from memgas.pipeline.errors import DataError
from memgas.pipeline.ingest import append, ingest, is_current
from memgas.pipeline.locks import LOCK


def _session(sid: str, date: str, text: str) -> dict:
    return {"session_id": sid, "date": date,
            "turns": [{"role": "user", "content": text}, {"role": "assistant", "content": f"ok: {text}"}]}


def _record(hid: str, sessions: list[dict], questions: list[dict] | None = None) -> dict:
    return {"history_id": hid, "speakers": ["user", "assistant"], "sessions": sessions, "questions": questions or []}


def _q(qid: str, hid: str, ev: list[str]) -> dict:
    return {"query_id": qid, "question": f"what about {qid}?", "answer": "x", "question_date": "2024-12-01",
            "question_type": "single-session-user", "evidence_session_ids": ev}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tables(bank_dir: Path) -> dict[str, list]:
    b = Bank(bank_dir)
    return {n: sorted(json.dumps(r, sort_keys=True, default=str) for r in b.read(n).to_pylist()) for n in INGEST_TABLES}


def _files(bank_dir: Path) -> dict[str, str]:
    return {str(f.relative_to(bank_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(bank_dir.rglob("*")) if f.is_file() and f.name != LOCK}


@pytest.fixture()
def base(tmp_path: Path) -> tuple[Path, Path]:
    f = _write(tmp_path / "base.jsonl", [
        _record("u1", [_session("s1", "2024-01-01 10:00", "I moved to Oslo."),
                       _session("s2", "2024-02-01 10:00", "My cat is Tom.")], [_q("u1:q0", "u1", ["s1"])]),
        _record("u2", [_session("t1", "2024-01-05 09:00", "I play chess.")]),
    ])
    bank = tmp_path / "bank"
    ingest(f, "jsonl", bank, progress=False)
    return f, bank


def _delta(tmp_path: Path) -> Path:
    return _write(tmp_path / "delta.jsonl", [
        # u1 again: one session already there (skipped), two new ones, a new question
        _record("u1", [_session("s2", "2024-02-01 10:00", "My cat is Tom."),
                       _session("s3", "2024-03-01 10:00", "I started running."),
                       _session("s4", "2024-04-01 10:00", "I ran 10 km.")], [_q("u1:q1", "u1", ["s3"])]),
        _record("u3", [_session("v1", "2024-01-01 08:00", "New user here.")], [_q("u3:q0", "u3", ["v1"])]),
    ])


def test_append_extends_histories_and_adds_new_ones(base: tuple[Path, Path], tmp_path: Path) -> None:
    f, bank = base
    before = Bank(bank).read("sessions").to_pylist()
    s = append(_delta(tmp_path), "jsonl", bank, progress=False)
    assert s["committed"] and s["counts"]["sessions"] == 3 and s["counts"]["histories"] == 1
    assert s["counts"]["histories_extended"] == 1 and s["counts"]["queries"] == 2
    b = Bank(bank)
    ses = {(r["history_id"], r["session_id"]): r for r in b.read("sessions").to_pylist()}
    # positions continue after the existing ones; old rows untouched
    assert [ses[("u1", x)]["position"] for x in ("s1", "s2", "s3", "s4")] == [0, 1, 2, 3]
    assert ses[("u3", "v1")]["position"] == 0
    assert all(ses[(r["history_id"], r["session_id"])] == r for r in before)
    hist = {r["history_id"]: r["n_sessions"] for r in b.read("histories").to_pylist()}
    assert hist == {"u1": 4, "u2": 1, "u3": 1}
    assert sorted(b.read("queries", ["query_id"]).column("query_id").to_pylist()) == ["u1:q0", "u1:q1", "u3:q0"]
    texts = set(b.read("texts", ["text_hash"]).column("text_hash").to_pylist())
    assert {r["text_hash"] for r in ses.values()} <= texts and b.count("texts") == len(texts)
    # the manifest records the append after the base ingest; the base file still counts as current
    ds = b.manifest["datasets"]
    assert len(ds) == 2 and ds[1]["kind"] == "append" and ds[1]["sessions_from"] == {"u1": 2}
    assert ds[1]["recompute_from"] == {} and is_current(bank, f, "jsonl")


def test_append_twice_changes_nothing(base: tuple[Path, Path], tmp_path: Path) -> None:
    _, bank = base
    d = _delta(tmp_path)
    append(d, "jsonl", bank, progress=False)
    tables, files = _tables(bank), _files(bank)
    s = append(d, "jsonl", bank, progress=False)
    assert not s["committed"]
    assert _tables(bank) == tables and _files(bank) == files  # byte-identical parts and manifest


def test_out_of_order_session_is_refused_then_reordered(base: tuple[Path, Path], tmp_path: Path) -> None:
    _, bank = base
    files = _files(bank)
    late = _write(tmp_path / "late.jsonl", [
        _record("u1", [_session("s0", "2024-01-15 10:00", "Between s1 and s2.")])])
    with pytest.raises(DataError, match="dated before the last session"):
        append(late, "jsonl", bank, progress=False)
    assert _files(bank) == files
    # the CLI: one line, exit 2, bank unchanged
    p = subprocess.run([sys.executable, "-m", "memgas", "ingest", str(late), "--append", "--out", str(bank)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "allow-reorder" in p.stderr
    assert _files(bank) == files
    s = append(late, "jsonl", bank, allow_reorder=True, progress=False)
    assert s["recompute_from"] == {"u1": 1}
    ses = {r["session_id"]: r["position"] for r in Bank(bank).read("sessions").to_pylist() if r["history_id"] == "u1"}
    assert ses == {"s1": 0, "s0": 1, "s2": 2}
    assert Bank(bank).manifest["datasets"][-1]["recompute_from"] == {"u1": 1}


def test_an_undated_last_session_does_not_let_an_earlier_one_through(base: tuple[Path, Path], tmp_path: Path) -> None:
    """The order check compares with the history's last *dated* session: an undated one appended first used to
    disable it, and a session dated a year before the history's dates went to the end without a word."""
    _, bank = base
    undated = {"session_id": "s3", "turns": [{"role": "user", "content": "No date here."}]}
    append(_write(tmp_path / "undated.jsonl", [_record("u1", [undated])]), "jsonl", bank, progress=False)
    files = _files(bank)
    old = _write(tmp_path / "old.jsonl", [_record("u1", [_session("s0", "2023-01-01 10:00", "Long ago.")])])
    with pytest.raises(DataError, match="'s0' \\(2023-01-01 10:00\\) is dated before the last session 's2' "
                                        "\\(2024-02-01 10:00\\)"):
        append(old, "jsonl", bank, progress=False)
    assert _files(bank) == files
    s = append(old, "jsonl", bank, allow_reorder=True, progress=False)
    assert s["recompute_from"] == {"u1": 0}
    ses = {r["session_id"]: r["position"] for r in Bank(bank).read("sessions").to_pylist() if r["history_id"] == "u1"}
    assert ses == {"s0": 0, "s1": 1, "s2": 2, "s3": 3}


def test_an_append_whose_sessions_were_all_skipped_does_not_say_they_are_there(base: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    """A session with no turns is skipped with a warning; the closing line used to say every session of the file
    was in the bank already, which is false (the session was never stored)."""
    _, bank = base
    f = _write(tmp_path / "no_turns.jsonl", [_record("u1", [{"session_id": "s6", "date": "2024-06-01 10:00",
                                                             "turns": []}])])
    p = subprocess.run([sys.executable, "-m", "memgas", "-q", "ingest", str(f), "--append", "--out", str(bank)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout == (f"nothing to append to {bank}: {f} adds no new session or question "
                        "(1 warnings (empty_session 1); see the log)\n")


def test_bad_file_or_conflict_leaves_bank_as_it_was(base: tuple[Path, Path], tmp_path: Path) -> None:
    _, bank = base
    files = _files(bank)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record("u9", [_session("z1", "2024-01-01", "fine")])) + "\n{not json\n")
    with pytest.raises(DataError):
        append(bad, "jsonl", bank, progress=False, chunk_histories=1)  # a part was written before the error
    assert _files(bank) == files
    changed = _write(tmp_path / "changed.jsonl", [_record("u1", [_session("s2", "2024-02-01 10:00", "Other text.")])])
    with pytest.raises(DataError, match="other content"):
        append(changed, "jsonl", bank, progress=False)
    assert _files(bank) == files


def test_append_interrupted_by_kill_leaves_bank_unchanged(base: tuple[Path, Path], tmp_path: Path) -> None:
    """A kill after a part was written and before the commit: the bank reads as before; the next append
    drops the leftover part and commits."""
    _, bank = base
    d = _delta(tmp_path)
    tables = _tables(bank)
    code = ("import os, sys\nfrom memgas.pipeline import faults, ingest\n"
            "faults.hit = lambda name: os._exit(9) if name == 'ingest:before-commit' else None\n"
            f"ingest.append({str(d)!r}, 'jsonl', {str(bank)!r}, progress=False)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    assert list((bank / "sessions").glob("ingest-*-x0001-*.parquet"))  # staged, not committed
    assert _tables(bank) == tables
    append(d, "jsonl", bank, progress=False)
    assert Bank(bank).count("sessions") == 6


def test_a_new_question_may_name_old_sessions_and_come_without_sessions(base: tuple[Path, Path], tmp_path: Path) -> None:
    """A question appended to a known history keeps evidence that is in the bank (not in the file), and a
    record with only questions adds them; evidence named nowhere is still dropped with a warning."""
    _, bank = base
    f = _write(tmp_path / "q.jsonl", [
        _record("u1", [_session("s3", "2024-03-01 10:00", "I started running.")], [_q("u1:q1", "u1", ["s1", "s3"])]),
        _record("u2", [], [_q("u2:q0", "u2", ["t1", "nowhere"])]),
    ])
    summary = append(f, "jsonl", bank, progress=False)
    queries = {r["query_id"]: r for r in Bank(bank).read("queries").to_pylist()}
    assert queries["u1:q1"]["evidence_session_ids"] == ["s1", "s3"]
    assert queries["u2:q0"]["evidence_session_ids"] == ["t1"]
    assert summary["counts"]["queries"] == 2 and summary["warning_count"] == 1
    assert "nowhere" in json.dumps(summary["warnings"])


def _append_cli(f: Path, bank: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memgas", "ingest", str(f), "--append", "--out", str(bank)],
                          capture_output=True, text=True)


def test_a_known_session_with_another_date_is_refused_like_changed_text(base: tuple[Path, Path], tmp_path: Path) -> None:
    """A session re-sent with another date was "nothing to append" (exit 0) and kept its old date
    silently. A re-sent session must be the same in every field (position aside): else the one line that
    changed text gets, exit 2, the bank unchanged."""
    _, bank = base
    files = _files(bank)
    lines = []
    for name, date, text in (("changed", "2024-02-01 10:00", "Other text."), ("redated", "2024-02-02 10:00", "My cat is Tom."),
                             ("reformatted", "2024/02/01 10:00", "My cat is Tom.")):
        f = _write(tmp_path / f"{name}.jsonl", [_record("u1", [_session("s2", date, text)])])
        p = _append_cli(f, bank)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (name, p.returncode, p.stderr)
        lines.append(p.stderr.strip().replace(str(f), "FILE"))
        assert _files(bank) == files
    assert lines[0] == lines[1] == lines[2]
    assert "'s2' is already in history 'u1' with other content" in lines[0]


def test_a_question_only_record_for_an_unknown_history_is_refused(base: tuple[Path, Path], tmp_path: Path) -> None:
    """A record with questions and no sessions adds questions to a history the bank holds; for a
    history it does not hold (a typo in the id, say) its questions were dropped with a warning and exit 0.
    Refused: one line naming the record, exit 2, the bank unchanged."""
    _, bank = base
    files = _files(bank)
    f = _write(tmp_path / "orphan.jsonl", [_record("u2", [], [_q("u2:q9", "u2", ["t1"])]),
                                           _record("u9", [], [_q("u9:q0", "u9", [])])])
    p = _append_cli(f, bank)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "record 1 (id=u9)" in p.stderr and "not in the bank" in p.stderr, p.stderr
    assert _files(bank) == files


def test_row_counts_of_a_grown_bank_count_each_row_once(base: tuple[Path, Path], tmp_path: Path) -> None:
    """An append rewrites the history rows it extends (and, reordering, the session rows it moves) in new
    parts, which readers merge by key: Bank.count and the manifest's row_counts counted both copies."""
    _, bank = base
    append(_delta(tmp_path), "jsonl", bank, progress=False)
    late = _write(tmp_path / "late.jsonl", [_record("u1", [_session("s0", "2024-01-15 10:00", "Between s1 and s2.")])])
    append(late, "jsonl", bank, allow_reorder=True, progress=False)
    b = Bank(bank)
    want = {t: b.read(t).num_rows for t in INGEST_TABLES}
    assert want["histories"] == 3 and want["sessions"] == 7
    assert {t: b.count(t) for t in INGEST_TABLES} == want
    assert {t: b.manifest["row_counts"][t] for t in INGEST_TABLES} == want


def test_the_stale_bank_warning_does_not_send_a_grown_bank_to_memgas_run(base: tuple[Path, Path], tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """`index`/`answer` with a config naming another file: the warning said "memgas run re-ingests", which on a
    grown bank is refused (it would drop the appends); it now says the results describe the bank and its appends."""
    import logging

    from memgas.jobs.main_job import warn_if_stale_bank
    from memgas.pipeline.config import MemgasConfig

    _, bank = base
    other = _write(tmp_path / "other.jsonl", [_record("u9", [_session("z1", "2024-01-01 10:00", "Other data.")])])
    cfg = MemgasConfig.load(None, [f"data.path={other}", "data.format=jsonl"])
    with caplog.at_level(logging.WARNING):
        warn_if_stale_bank(cfg, Bank(bank))
    assert [r.getMessage().endswith("(memgas run re-ingests)") for r in caplog.records] == [True]
    caplog.clear()
    append(_delta(tmp_path), "jsonl", bank, progress=False)
    with caplog.at_level(logging.WARNING):
        warn_if_stale_bank(cfg, Bank(bank))
    assert [r.getMessage().endswith("results describe the bank's dataset and its appends") for r in caplog.records] == [True]


@pytest.mark.parametrize("chunk_histories", [1, 500])
def test_an_append_writes_what_the_bank_lacks_once_in_any_batches(base: tuple[Path, Path], tmp_path: Path,
                                                                  chunk_histories: int) -> None:
    """The bank's hashes are looked up per batch of records (not loaded whole): a text or session the bank
    holds (another history's) is not written again, one repeated inside the file is written once, in batches
    of one record or of all. The oracle: the delta ingested alone into a bank of its own, minus the base."""
    _, bank = base
    chess = _session("s3", "2024-03-01 10:00", "I play chess.")  # u2's session t1, word for word
    delta = _write(tmp_path / "d.jsonl", [
        _record("u1", [chess, _session("s4", "2024-04-01 10:00", "I ran 10 km.")]),
        _record("u3", [{**chess, "session_id": "v1"}]),  # the same session again, in a new history
        _record("u4", [_session("w1", "2024-01-01 08:00", "Only here.")]),
    ])
    alone = tmp_path / "alone"
    ingest(delta, "jsonl", alone, progress=False)
    before = {t: {json.dumps(r, sort_keys=True, default=str) for r in Bank(bank).read(t).to_pylist()}
              for t in ("texts", "turns", "pairs")}
    s = append(delta, "jsonl", bank, progress=False, chunk_histories=chunk_histories)
    b = Bank(bank)
    for t in ("texts", "turns", "pairs"):
        want = {json.dumps(r, sort_keys=True, default=str) for r in Bank(alone).read(t).to_pylist()} - before[t]
        new = [p for p in b.parts(t) if "-x0001-" in p]
        got = [json.dumps(r, sort_keys=True, default=str) for r in b.read(t, parts=new, dedupe=False).to_pylist()]
        assert sorted(got) == sorted(want) and want, t  # each once, none the bank held
        assert s["counts"][t] == len(want)
    assert {r["history_id"]: r["n_sessions"] for r in b.read("histories").to_pylist()} == {"u1": 4, "u2": 1, "u3": 1,
                                                                                          "u4": 1}


def test_a_known_session_with_other_has_answer_marks_is_refused(base: tuple[Path, Path], tmp_path: Path) -> None:
    """A session re-sent with other has_answer marks on its turns was "nothing to append" (exit 0) and kept
    the old marks. Refused like changed text: one line, exit 2, the bank unchanged; the same marks re-sent
    are still nothing to append."""
    f0, bank = base
    files = _files(bank)
    s2 = _session("s2", "2024-02-01 10:00", "My cat is Tom.")
    s2["turns"][0]["has_answer"] = True
    f = _write(tmp_path / "marked.jsonl", [_record("u1", [s2])])
    p = _append_cli(f, bank)
    assert (p.returncode, p.stdout, p.stderr.strip()) == (2, "", (
        f"memgas ingest: error: {f}: record 0 (id=u1): session 's2' is already in history 'u1' with other "
        "has_answer or dia_id marks on its turns (an append adds sessions, it never changes one)"))
    assert _files(bank) == files
    p = _append_cli(f0, bank)
    assert (p.returncode, p.stdout.strip()) == (
        0, f"nothing to append to {bank}: every session and question of {f0} is there already"), p.stderr
    assert _files(bank) == files


def test_replace_and_append_together_are_refused(base: tuple[Path, Path], tmp_path: Path) -> None:
    """`ingest --replace --append` was accepted silently (an append): the pair asks for two opposite things.
    An argument error (exit 2), the bank unchanged."""
    _, bank = base
    files = _files(bank)
    f = _write(tmp_path / "more.jsonl", [_record("u3", [_session("v1", "2024-03-01 10:00", "I swim.")])])
    p = subprocess.run([sys.executable, "-m", "memgas", "ingest", str(f), "--replace", "--append", "--out", str(bank)],
                       capture_output=True, text=True)
    assert (p.returncode, p.stdout, p.stderr.strip()) == (2, "", (
        "memgas ingest: error: --replace does not go with --append: --append adds the file to the bank, "
        "--replace starts the bank over with it"))
    assert _files(bank) == files


def test_report_compares_runs_over_the_same_data_split_otherwise_as_comparable(base: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    """`memgas report A B` called two runs over identical data "not comparable" when their appends were
    split differently (the dataset's sha256 digests the files in order). Runs are compared by the content
    of the data (metrics.json ``dataset.content_sha256``, the job's ``dataset_identity``): the same rows
    in one append, in two, or in one file compare as the same data; other rows do not."""
    from memgas.pipeline.append import dataset_identity

    f0, _ = base
    s3 = _session("s3", "2024-03-01 10:00", "I bought a bike.")
    t2 = _session("t2", "2024-02-05 09:00", "I lost at chess.")
    u3 = _record("u3", [_session("v1", "2024-03-01 10:00", "I swim.")], [_q("u3:q0", "u3", ["v1"])])
    both = _write(tmp_path / "both.jsonl", [_record("u1", [s3]), _record("u2", [t2]), u3])
    first = _write(tmp_path / "first.jsonl", [_record("u1", [s3])])
    rest = _write(tmp_path / "rest.jsonl", [_record("u2", [t2]), u3])
    whole = _write(tmp_path / "whole.jsonl", [json.loads(line) for line in f0.read_text().splitlines()])
    rows = [json.loads(line) for line in whole.read_text().splitlines()]
    rows[0]["sessions"].append(s3)
    rows[1]["sessions"].append(t2)
    whole.write_text("".join(json.dumps(r) + "\n" for r in [*rows, u3]))
    splits = {"one-append": [both], "two-appends": [first, rest], "one-file": [], "less": [first]}
    runs = {}
    for name, appends in splits.items():
        bank = tmp_path / f"bank-{name}"
        ingest(whole if name == "one-file" else f0, "jsonl", bank, progress=False)
        for f in appends:
            append(f, "jsonl", bank, progress=False)
        run = runs[name] = tmp_path / f"run-{name}"
        run.mkdir()
        metrics = {"run": {"name": name}, "dataset": dataset_identity(Bank(bank)), "retrieval": {"session": {}}}
        (run / "metrics.json").write_text(json.dumps(metrics, default=str))

    def report(*names: str) -> str:
        out = subprocess.run([sys.executable, "-m", "memgas", "report", *(str(runs[n]) for n in names)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    for a, b in (("one-append", "two-appends"), ("one-append", "one-file")):
        text = report(a, b)
        assert "different datasets" not in text and "cannot be checked" not in text, (a, b, text)
    differ = report("two-appends", "less").splitlines()
    assert [line for line in differ if "not comparable" in line] == [
        "**Warning: these runs used different datasets; their numbers are not comparable.** run-two-appends: "
        f"base.jsonl + 2 appended (sha256 {dataset_identity(Bank(tmp_path / 'bank-two-appends'))['sha256'][:12]}); run-less: "
        f"base.jsonl + 1 appended (sha256 {dataset_identity(Bank(tmp_path / 'bank-less'))['sha256'][:12]})"]

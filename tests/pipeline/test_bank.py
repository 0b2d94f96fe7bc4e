"""The bank's crash safety: compaction and part writes killed (SIGKILL) or failed (ENOSPC) at every named
fault point leave readable data, and the next compaction recovers; unreadable parts can be deleted and
rebuilt; files get the usual permissions.

Faults are injected into a real subprocess with MEMGAS_FAULT (see memgas.pipeline.faults).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

from memgas.pipeline.bank import COMPACT_PREFIX, Bank
from memgas.pipeline.errors import BankError
from memgas.pipeline.hashing import text_hash
from memgas.pipeline.ingest import ingest, is_current

SAMPLE3 = Path(__file__).resolve().parents[2] / "data" / "sample" / "longmemeval_s_sample3.json"


def _texts(words: list[str]) -> pa.Table:
    return pa.table({"text_hash": [text_hash(w) for w in words], "text": words})


def _rows(bank: Bank, name: str = "texts") -> list[tuple]:
    t = bank.read(name)
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names)))


def _bank_with_parts(path: Path) -> Bank:
    """A texts table of three unit parts (one key written twice with the same text) and a compacted part."""
    bank = Bank.create(path)
    bank.write("texts", _texts(["alpha", "beta"]))  # an earlier compaction
    bank.write_part("texts", "derived-1", _texts(["gamma", "delta"]))
    bank.write_part("texts", "derived-2", _texts(["epsilon", "beta"]))
    bank.write_part("texts", "queries-1", _texts(["zeta?"]))
    return bank


# -- compaction ---------------------------------------------------------------------------------------------
def test_compaction_merges_sorts_and_is_idempotent(tmp_path: Path) -> None:
    bank = _bank_with_parts(tmp_path / "b")
    before = _rows(bank)
    assert len(before) == 6 and bank.count("texts") == 6  # exact even with the overlapping "beta"
    n = bank.compact("texts")
    parts = bank.parts("texts")
    assert n == 6 and len(parts) == 1 and parts[0].startswith(COMPACT_PREFIX)
    assert _rows(bank) == before
    t = bank.read("texts")
    assert t.column("text_hash").to_pylist() == sorted(t.column("text_hash").to_pylist())
    # nothing else is left in the table's directory
    assert sorted(p.name for p in (tmp_path / "b" / "texts").iterdir()) == ["_done", f"{parts[0]}.parquet"]
    # compacting again changes nothing; writing the same rows gives the same part (named by its bytes)
    assert bank.compact("texts") == 6 and bank.parts("texts") == parts
    assert bank.write("texts", bank.read("texts")) == parts[0]


def _run_compaction(bank_dir: Path, fault: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from memgas.pipeline.bank import Bank
        Bank({str(bank_dir)!r}).compact("texts")
    """)
    env = {**os.environ, "MEMGAS_FAULT": fault}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


FAULTS = [
    "kill@bank:compact:merging",
    "enospc@bank:compact:merging",
    "kill@bank:compact:before-rename",
    "kill@bank:compact:before-marker",
    "kill@bank:compact-marker:before-rename",
    "kill@bank:compact:after-new",
    "kill@bank:compact:dropped",
    "kill@bank:compact:dropped#3",
    "enospc@bank:compact:before-rename",
    "enospc@bank:compact-marker:before-rename",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_compaction_is_crash_safe_at_every_point(tmp_path: Path, fault: str) -> None:
    bank = _bank_with_parts(tmp_path / "b")
    before = _rows(bank)
    clean = _bank_with_parts(tmp_path / "clean")
    clean.compact("texts")

    proc = _run_compaction(tmp_path / "b", fault)
    if fault.startswith("kill"):
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and "No space left on device" in proc.stderr
    # the data stays readable, complete and not duplicated, whatever the instruction
    bank = Bank(tmp_path / "b")
    assert _rows(bank) == before
    assert bank.count("texts") == len(before)
    # the next compaction recovers: one part, the same bytes as an uninterrupted compaction
    bank.compact("texts")
    assert bank.parts("texts") == clean.parts("texts")
    name = clean.parts("texts")[0]
    assert (tmp_path / "b" / "texts" / f"{name}.parquet").read_bytes() == (
        tmp_path / "clean" / "texts" / f"{name}.parquet").read_bytes()
    assert not [p for p in (tmp_path / "b" / "texts").iterdir() if p.name.startswith(".")]  # no temp files


def test_the_old_failure_a_kill_while_replacing_the_compacted_part(tmp_path: Path) -> None:
    """Before: write("all") unmarked the old compacted part first, so a kill there lost every ingested text
    and each later run failed with "N session texts missing". Now the old part stays marked until the new
    one is complete."""
    bank = Bank.create(tmp_path / "b")
    bank.write("texts", _texts([f"session {i}" for i in range(50)]))
    bank.write_part("texts", "derived-x", _texts(["a summary"]))
    before = _rows(bank)
    for fault in ("kill@bank:compact:before-rename", "kill@bank:compact:before-marker"):
        assert _run_compaction(tmp_path / "b", fault).returncode == -signal.SIGKILL
        assert _rows(Bank(tmp_path / "b")) == before


@pytest.mark.parametrize("fault, rc", [("kill@bank:write-part:before-marker", -9),
                                       ("kill@bank:write-part:before-rename", -9),
                                       ("enospc@bank:write-part:before-rename", 1),
                                       ("kill@bank:write-marker:before-rename", -9)])
def test_a_part_killed_while_written_is_ignored(tmp_path: Path, fault: str, rc: int) -> None:
    bank = _bank_with_parts(tmp_path / "b")
    before = _rows(bank)
    code = textwrap.dedent(f"""
        import pyarrow as pa
        from memgas.pipeline.bank import Bank
        from memgas.pipeline.hashing import text_hash
        Bank({str(tmp_path / 'b')!r}).write_part("texts", "derived-3", pa.table({{"text_hash": [text_hash("new")], "text": ["new"]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MEMGAS_FAULT": fault},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == rc, proc.stderr[-2000:]
    bank = Bank(tmp_path / "b")
    assert "derived-3" not in bank.parts("texts") and _rows(bank) == before
    if fault.startswith("enospc"):
        assert not [p for p in (tmp_path / "b" / "texts").iterdir() if p.name.startswith(".")]


# -- ingest parts are ingest's own ----------------------------------------------------------------------------
def test_compaction_keeps_ingest_parts_and_does_not_copy_their_rows(tmp_path: Path) -> None:
    ingest(SAMPLE3, "longmemeval", tmp_path / "b", progress=False)
    bank = Bank(tmp_path / "b")
    ingested = bank.parts("texts")
    n_ingested = bank.count("texts")
    bank.write_part("texts", "derived-1", _texts(["a summary", "keywords; here"]))
    # what jobs/plan.compact does: read everything, write it back
    bank.write("texts", bank.read("texts"))
    parts = bank.parts("texts")
    assert [p for p in parts if p.startswith("ingest-")] == ingested
    compacted = [p for p in parts if p.startswith(COMPACT_PREFIX)]
    assert len(compacted) == 1 and bank._rows("texts", compacted[0]) == 2  # only the derived rows
    assert bank.count("texts") == n_ingested + 2
    assert bank.compact("texts") == 2 and bank.parts("texts") == parts


# -- unreadable parts: the advice works --------------------------------------------------------------------------
def test_unreadable_cache_part_delete_and_rerun(tmp_path: Path) -> None:
    bank = _bank_with_parts(tmp_path / "b")
    path = tmp_path / "b" / "texts" / "derived-1.parquet"
    path.write_bytes(b"garbage".ljust(path.stat().st_size, b"\0"))  # the size written: only a read finds it
    with pytest.raises(BankError, match="unreadable Parquet part .*delete it and re-run"):
        bank.read("texts")
    (tmp_path / "b" / "texts" / "derived-1.parquet").unlink()
    assert len(_rows(bank)) == 4  # the other parts still read; the stage would recompute the lost rows


@pytest.mark.parametrize("table", ["queries", "texts", "sessions"])
def test_unreadable_ingest_part_delete_and_reingest(tmp_path: Path, table: str) -> None:
    ingest(SAMPLE3, "longmemeval", tmp_path / "b", progress=False, chunk_histories=1)
    bank = Bank(tmp_path / "b")
    want = _rows(bank, table)
    part = bank.parts(table)[1]
    path = tmp_path / "b" / table / f"{part}.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(BankError, match="re-ingests"):
        bank.read(table)
    path.unlink()  # what the message says
    # the bank now says it holds no usable dataset: a run re-ingests instead of trusting a partial bank
    assert not bank.exists("sessions") and not bank.exists(table) and not bank.ingest_complete()
    assert not is_current(tmp_path / "b", SAMPLE3, "longmemeval")
    with pytest.raises(BankError, match="incomplete"):
        bank.read("queries")
    ingest(SAMPLE3, "longmemeval", tmp_path / "b", progress=False, chunk_histories=1)
    assert _rows(Bank(tmp_path / "b"), table) == want and is_current(tmp_path / "b", SAMPLE3, "longmemeval")


#: run in a child process: a regression reads /dev/zero for ever or blocks on the FIFO, and must fail the test
#: (killed at the timeout), not hang the suite or leave a spinning thread in it
_NOT_A_FILE_PROBE = textwrap.dedent("""
    import json, os, sys
    from memgas.pipeline.bank import Bank
    bank, kind = Bank(sys.argv[1]), sys.argv[2]
    path = bank.path / "texts" / "derived-1.parquet"
    path.unlink()
    os.symlink("/dev/zero", path) if kind == "symlink to /dev/zero" else os.mkfifo(path)
    out = {"verify_part": bank.verify_part("texts", "derived-1"), "current_digest": bank.current_digest("texts", "derived-1"),
           "parts": [p[:4] if p.startswith("all-") else p for p in bank.parts("texts")], "count": bank.count("texts"),
           "read": sorted(bank.read("texts")["text"].to_pylist())}
    print(json.dumps(out))
""")


@pytest.mark.parametrize("kind", ["symlink to /dev/zero", "FIFO"])
def test_a_part_that_is_not_a_regular_file_is_damaged_not_read_for_ever(tmp_path: Path, kind: str) -> None:
    _bank_with_parts(tmp_path / "b")
    try:
        proc = subprocess.run([sys.executable, "-c", _NOT_A_FILE_PROBE, str(tmp_path / "b"), kind],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the bank read a part that is a {kind} for 60 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    # damaged, hence missing: passed by without being opened, its rows absent until its stage writes it again
    assert got == {"verify_part": False, "current_digest": None, "parts": ["all-", "derived-2", "queries-1"],
                   "count": 4, "read": ["alpha", "beta", "epsilon", "zeta?"]}


_FIFO_MARKER_PROBE = textwrap.dedent("""
    import os, sys
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.errors import BankError
    bank = Bank(sys.argv[1])
    marker = bank.path / "texts" / "_done" / "derived-1.json"
    marker.unlink()
    os.mkfifo(marker)
    print(bank.verify_part("texts", "derived-1"), bank.part_digest("texts", "derived-1"))
    (bank.path / "manifest.json").unlink()  # replaced while the bank is open
    os.mkfifo(bank.path / "manifest.json")
    try:
        bank.manifest
    except BankError as exc:
        print(exc)
""")


def test_a_marker_or_manifest_that_is_a_fifo_is_never_waited_on(tmp_path: Path) -> None:
    _bank_with_parts(tmp_path / "b")
    try:
        proc = subprocess.run([sys.executable, "-c", _FIFO_MARKER_PROBE, str(tmp_path / "b")], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the bank waited on a FIFO for 60 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "False None", f"{tmp_path / 'b' / 'manifest.json'}: corrupt manifest: not a regular file: a FIFO"]


def test_a_part_marker_records_its_size(tmp_path: Path) -> None:
    """Checked before any byte is hashed: a part of another size is damaged without reading it."""
    bank = _bank_with_parts(tmp_path / "b")
    for part in bank.parts("texts"):
        marker = json.loads((tmp_path / "b" / "texts" / "_done" / f"{part}.json").read_text())
        assert marker["bytes"] == (tmp_path / "b" / "texts" / f"{part}.parquet").stat().st_size
    path = tmp_path / "b" / "texts" / "derived-1.parquet"
    with path.open("ab") as f:  # same leading bytes, one more at the end
        f.write(b"\0")
    assert bank.verify_part("texts", "derived-1") is False and bank.verify_part("texts", "derived-2") is True


# -- files ----------------------------------------------------------------------------------------------------
def test_files_get_the_umask_mode_not_0600(tmp_path: Path) -> None:
    mask = os.umask(0o022)
    try:
        bank = Bank.create(tmp_path / "b")
        bank.write_part("texts", "p", _texts(["x"]))
        bank.compact("texts")
        bank.update_manifest(x=1)
    finally:
        os.umask(mask)
    for f in [tmp_path / "b" / "manifest.json", *(tmp_path / "b" / "texts").rglob("*.*")]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_open_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(BankError, match="not a directory"):
        Bank(tmp_path / "file")
    with pytest.raises(BankError, match="exists and is not a directory"):
        Bank.create(tmp_path / "file")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text("[1, 2]")
    with pytest.raises(BankError, match="corrupt manifest"):
        Bank(tmp_path / "b")
    (tmp_path / "b" / "manifest.json").write_text("{not json")
    with pytest.raises(BankError, match="corrupt manifest"):
        Bank(tmp_path / "b")


def test_a_read_in_batches_equals_the_plain_read_and_embeddings_have_small_row_groups(tmp_path: Path) -> None:
    """``Bank.read(batch_rows=...)`` (the node-block reader's reads) returns the plain read's rows, filtered,
    in order and deduplicated across parts; embeddings parts are written in row groups of
    ``ROW_GROUP_ROWS["embeddings"]`` rows (a reader decodes a whole row group before filtering)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from memgas.pipeline import bank as bank_mod
    from memgas.pipeline.schema import embeddings_schema

    bank = Bank.create(tmp_path / "bank")
    n, dim = 20_000, 4
    vec = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * dim, dtype=np.float32)), dim)
    rows = {"text_hash": [f"t{i}" for i in range(n)], "encoder": ["e" if i % 3 else "f" for i in range(n)],
            "vector": vec, "truncated": [False] * n, "tokens": [1] * n, "tokens_dropped": [0] * n}
    bank.write("embeddings", pa.table(rows, schema=embeddings_schema(dim)), dim=dim)
    again = pa.table({k: v[:10] for k, v in rows.items()}, schema=embeddings_schema(dim))
    bank.write_part("embeddings", "later", again.set_column(2, "vector", pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(10 * dim, np.float32)), dim)))  # the same keys again: the later part wins
    (part,) = [p for p in bank.parts("embeddings") if p != "later"]
    meta = pq.ParquetFile(bank.path / "embeddings" / f"{part}.parquet").metadata
    assert meta.num_row_groups == -(-n // bank_mod.ROW_GROUP_ROWS["embeddings"])
    cols = ["text_hash", "encoder", "vector"]
    want_some = sorted(f"t{i}" for i in range(0, n, 7))
    for flt in (None, (pc.field("encoder") == "e") & pc.field("text_hash").isin(want_some)):
        plain = bank.read("embeddings", cols, filter=flt)
        for batch_rows in (1000, 8192):
            assert bank.read("embeddings", cols, filter=flt, batch_rows=batch_rows).equals(plain)
    assert bank.read("embeddings", cols, filter=pc.field("text_hash") == "none", batch_rows=64).num_rows == 0


@pytest.mark.parametrize("kind", ["FIFO", "symlink to /dev/zero"])
def test_a_manifest_that_is_not_a_regular_file_is_named_and_replaced_by_ingest_replace(tmp_path: Path,
                                                                                       kind: str) -> None:
    """A manifest.json that is a FIFO or a symlink to /dev/zero made every command, `ingest --replace`
    included, say "not a memory bank (no manifest.json)". Every command says what is wrong with it, at once
    (never waiting on it); a plain ingest refuses it and `ingest --replace` starts the bank over."""
    bank = tmp_path / "b"
    ingest(SAMPLE3, "longmemeval", bank, progress=False)
    want = _rows(Bank(bank), "queries")
    manifest = bank / "manifest.json"
    manifest.unlink()
    os.mkfifo(manifest) if kind == "FIFO" else os.symlink("/dev/zero", manifest)

    def memgas(*argv: str) -> tuple[int, str, str]:
        try:
            p = subprocess.run([sys.executable, "-m", "memgas", *argv], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"memgas {argv[0]} waited on a manifest that is a {kind} for 60 s")
        return p.returncode, p.stdout.strip(), p.stderr.strip()

    why = "a FIFO" if kind == "FIFO" else "a device"
    line = (f"{manifest}: corrupt manifest: not a regular file: {why}; start the bank over with "
            f"`memgas ingest FILE --replace --out {bank}`")
    assert memgas("stats", str(bank)) == (2, "", f"memgas stats: error: {line}")
    ingest_argv = ["ingest", str(SAMPLE3), "--format", "longmemeval", "--out", str(bank), "-q"]
    assert memgas(*ingest_argv) == (2, "", f"memgas ingest: error: {line}")
    code, out, err = memgas(*ingest_argv, "--replace")
    assert (code, err) == (0, ""), err
    assert manifest.is_file() and not manifest.is_symlink() and _rows(Bank(bank), "queries") == want


def test_a_verified_part_is_not_hashed_again_until_its_file_changes(tmp_path: Path, monkeypatch) -> None:
    """A part hashed once is trusted by a later use from its record while its file's (size, mtime, ctime,
    inode) are those recorded; a change that keeps size and mtime (bytes rewritten in place, mtime set back)
    moves ctime, and the part is hashed again and refused. A file changed within the racy window is never
    recorded."""
    from memgas.pipeline import bank_verified, hashing

    bank = Bank.create(tmp_path / "b")
    bank.write_part("texts", "p", _texts(["alpha", "beta"]))
    monkeypatch.setenv("MEMGAS_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "b" / "texts" / "p.parquet"
    record = bank_verified.record_path(path)
    assert record.is_relative_to(tmp_path / "cache")
    assert bank.verify_part("texts", "p") and not record.exists()  # just written: inside the racy window
    monkeypatch.setattr(bank_verified, "RACY_NS", -10**12)  # as if it had been written long ago
    assert bank.verify_part("texts", "p") and record.exists()

    def no_hash(p):  # a fresh process: no digest cached in memory either
        raise AssertionError(f"hashed {p}")
    monkeypatch.setattr(bank_verified, "file_digest", no_hash)
    assert bank.verify_part("texts", "p") and Bank(tmp_path / "b").verify_part("texts", "p")

    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:  # same size, same inode
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back; ctime cannot be
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_ino == st.st_ino
    monkeypatch.setattr(bank_verified, "file_digest", hashing.file_digest)
    assert not bank.verify_part("texts", "p")
    bank.drop_part("texts", "p")
    assert not record.exists()

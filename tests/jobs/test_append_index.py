"""Index after an append does only the new rows, and gives what a fresh index of the same data gives.

Property: ``ingest A, index, ingest B --append, index, answer`` has the same edges and rankings,
byte for byte, as ``ingest A, ingest B --append, index, answer`` (one build over everything). Run through
the CLI in-process, with the real LLM-free generator and MiniLM encoder, no Ray.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memgas.pipeline.bank import Bank

REPO = Path(__file__).resolve().parents[2]

TOPICS = [
    ("hiking", ["trail", "boots", "summit", "map", "rain", "lake"]),
    ("cooking", ["pasta", "garlic", "oven", "recipe", "basil", "soup"]),
    ("work", ["meeting", "deadline", "manager", "report", "laptop", "office"]),
    ("music", ["guitar", "concert", "piano", "song", "band", "lesson"]),
    ("travel", ["flight", "hotel", "passport", "Lisbon", "train", "museum"]),
]

CONFIG = ["--set", "retrieval.methods=[session,memgas,memgas-no-gmm]", "--set", "reading.enabled=false",
          "--set", "evaluation.ks=[1,3,5]", "--set", "ray.shard_size=1", "--set", "evaluation.plots=false"]


def _session(h: int, s: int) -> dict:
    """Session ``s`` of history ``h``: turns about one topic, words picked by a fixed rule (no RNG)."""
    name, words = TOPICS[(h * 3 + s * 7) % len(TOPICS)]
    turns = []
    for t in range(4):
        w1, w2 = words[(s + t) % len(words)], words[(s * 2 + t * 3 + h) % len(words)]
        role = "user" if t % 2 == 0 else "assistant"
        turns.append({"role": role, "content": f"Session {s}: about {name}, the {w1} and the {w2} ({h}.{s}.{t})."})
    return {"session_id": f"h{h}s{s}", "date": f"2024-{1 + s // 28:02d}-{1 + s % 28:02d} 10:00", "turns": turns}


def _question(h: int, s: int) -> dict:
    name, words = TOPICS[(h * 3 + s * 7) % len(TOPICS)]
    return {"query_id": f"h{h}:q{s}", "question": f"What did I say about the {words[s % len(words)]} and {name}?",
            "answer": words[s % len(words)], "question_date": "2025-01-01", "question_type": "single-session-user",
            "evidence_session_ids": [f"h{h}s{s}"]}


def _file(path: Path, spans: dict[int, range], questions: dict[int, list[int]]) -> Path:
    records = [{"history_id": f"h{h}", "speakers": ["user", "assistant"], "sessions": [_session(h, s) for s in r],
                "questions": [_question(h, s) for s in questions.get(h, [])]} for h, r in spans.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("append_data")
    # A: two histories past min_prior_nodes (20 nodes = 5 sessions); B: more sessions of both, a new history
    a = _file(d / "a.jsonl", {0: range(0, 9), 1: range(0, 7)}, {0: [2, 6], 1: [3]})
    b = _file(d / "b.jsonl", {0: range(9, 13), 1: range(7, 10), 2: range(0, 8)}, {0: [11], 1: [8], 2: [1, 6]})
    return a, b


def _config(path: Path) -> list[str]:
    return ["--config", str(REPO / "configs" / "demo.yaml"), "--no-ray", *CONFIG]


def _edges(bank: Path) -> list[tuple]:
    t = Bank(bank).read("edges")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "mode", "src", "dst", "similarity"))))


def _segments(bank: Path) -> list[tuple]:
    t = Bank(bank).read("edge_segments")
    return sorted(zip(*(t[c].to_pylist() for c in ("history_id", "first_session", "end_session"))))


def _rankings(run: Path) -> tuple[list[dict], dict]:
    results = Bank(run / "results")
    rows = results.read("rankings").to_pylist()
    rows.sort(key=lambda r: (r["method"], r["query_id"], r["rank"]))
    return rows, json.loads((run / "metrics.json").read_text())["retrieval"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, files: tuple[Path, Path], cli: Callable) -> dict[str, Any]:
    """Two banks of the same ingest history (A, then B appended), indexed two ways, and answered:
    ``grown`` indexed after A and again after B (only B's rows computed the second time), ``fresh`` indexed
    once over everything. The tests below read them; none changes them (item 5's test works on copies)."""
    a, b = files
    d = tmp_path_factory.mktemp("built")
    grown, fresh = d / "grown", d / "fresh"
    out: dict[str, Any] = {"grown": grown, "fresh": fresh, "run_grown": d / "run_grown", "run_fresh": d / "run_fresh"}
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    out["edges_before"], out["segments_before"] = _edges(grown), _segments(grown)
    out["parts_before"] = {t: Bank(grown).parts(t) for t in Bank(grown).tables()}
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    cli("ingest", str(a), "--format", "jsonl", "--out", str(fresh))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(fresh))
    cli("index", str(fresh), *_config(fresh))
    cli("answer", str(grown), *_config(grown), "--out", str(out["run_grown"]))
    cli("answer", str(fresh), *_config(fresh), "--out", str(out["run_fresh"]))
    return out


@pytest.mark.slow
def test_index_after_append_equals_a_fresh_index_byte_for_byte(built: dict[str, Any]) -> None:
    grown, fresh = built["grown"], built["fresh"]
    # grown: index A, append B, index again (only B's rows are computed)
    assert built["segments_before"] == [("h0", 0, 9), ("h1", 0, 7)]
    assert _segments(grown) == [("h0", 0, 9), ("h0", 9, 13), ("h1", 0, 7), ("h1", 7, 10), ("h2", 0, 8)]
    after = _edges(grown)
    assert set(built["edges_before"]) <= set(after), "an append changed edges of old rows"
    # fresh: A and B ingested, one index over everything
    assert _segments(fresh) == [("h0", 0, 13), ("h1", 0, 10), ("h2", 0, 8)]
    assert after == _edges(fresh)
    assert len({e[0] for e in after if e[2] >= 4 * 9}) >= 2, "the appended rows made no edges: nothing tested"
    assert _rankings(built["run_grown"]) == _rankings(built["run_fresh"])
    # what the content stages committed is a digest of their rows, not of how the parts hold them: the grown
    # bank's generations and vectors digest as the fresh bank's (so every stage after has one fingerprint)
    for stage in ("generate", "encode", "associate"):
        marks = [json.loads((b / "_stages" / f"{stage}.json").read_text()) for b in (grown, fresh)]
        assert marks[0]["fingerprint"] == marks[1]["fingerprint"], stage
        if stage != "associate":
            assert marks[0]["output"] == marks[1]["output"] and marks[0]["rows_digest"] == "summed-1", stage


def _part_bytes(bank: Path, table: str) -> list[bytes]:
    """The table's Parquet files in part order (their names hold fingerprints, which differ by design)."""
    return [(bank / table / f"{p}.parquet").read_bytes() for p in Bank(bank).parts(table)]


@pytest.mark.slow
def test_the_rankings_parquet_of_a_grown_bank_equals_a_fresh_index_byte_for_byte(
        tmp_path: Path, built: dict[str, Any], files: tuple[Path, Path], cli: Callable) -> None:
    """The README says byte for byte, but the rankings of the appended-then-indexed bank held the
    same rows as a fresh index of the same data in one file, in another order (rows followed the order of
    the questions in the files). Every results table is written in one canonical row order (its key)."""
    a, b = files
    records = {}
    for f in (a, b):  # A + B as one file: histories and each history's questions in reverse order
        for line in f.read_text().splitlines():
            r = json.loads(line)
            have = records.setdefault(r["history_id"], {**r, "sessions": [], "questions": []})
            have["sessions"] += r["sessions"]
            have["questions"] = r["questions"][::-1] + have["questions"]
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in reversed(list(records.values()))))
    bank = tmp_path / "one"
    shutil.copytree(built["fresh"], bank)  # its caches: the index has nothing to compute again
    cli("ingest", str(one), "--format", "jsonl", "--replace", "--out", str(bank))
    cli("index", str(bank), *_config(bank))
    cli("answer", str(bank), *_config(bank), "--out", str(tmp_path / "run"))
    assert _rankings(tmp_path / "run") == _rankings(built["run_grown"])  # the same rows
    grown, fresh = _part_bytes(built["run_grown"] / "results", "rankings"), _part_bytes(tmp_path / "run" / "results", "rankings")
    assert grown and grown == fresh
    # no JustMem method here: no card ranker ran, so neither run has card_picks parts
    assert not (built["run_grown"] / "results" / "card_picks").exists() and not (tmp_path / "run" / "results" / "card_picks").exists()


@pytest.mark.slow
def test_a_grown_bank_names_its_whole_ingest_history_as_the_dataset(tmp_path: Path, built: dict[str, Any],
                                                                    files: tuple[Path, Path], cli: Callable) -> None:
    """After an append, metrics.json and report.md named the last appended file as the dataset
    (its sha256 and counts) while the run evaluated the whole bank, so `memgas report A B` judged runs by
    their last file. The dataset of a grown bank is its ingest history: two runs over the same history are
    the same data, whatever order they indexed in; the counts are the bank's."""
    a, b = files
    m = {k: json.loads((built[k] / "metrics.json").read_text())["dataset"] for k in ("run_grown", "run_fresh")}
    assert m["run_grown"] == m["run_fresh"]
    ds = m["run_grown"]
    bank = Bank(built["grown"])
    assert ds["counts"] == {"histories": 3, "sessions": 13 + 10 + 8, "queries": 3 + 4}
    assert ds["counts"] == {t: bank.read(t).num_rows for t in ("histories", "sessions", "queries")}
    assert ds["path"] == str(a.resolve()) and [x["path"] for x in ds["appends"]] == [str(b.resolve())]
    assert ds["sha256"] not in (bank.manifest["datasets"][0]["sha256"], bank.manifest["datasets"][1]["sha256"])
    assert json.loads((built["run_grown"] / "manifest.json").read_text())["dataset"] == ds
    report = (built["run_grown"] / "report.md").read_text()
    assert f"- **dataset sha256**: {ds['sha256']}" in report and "- **appended**: b.jsonl" in report, report[:800]
    same = cli("report", str(built["run_grown"]), str(built["run_fresh"]))
    assert "different datasets" not in same.stdout + same.stderr
    # another base file with the same append is other data, though its last file is the same
    other, base = tmp_path / "other", tmp_path / "h1.jsonl"
    base.write_text(a.read_text().splitlines(keepends=True)[1])  # A's second history alone
    cli("ingest", str(base), "--format", "jsonl", "--out", str(other))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(other))
    from memgas.pipeline.append import dataset_identity

    assert dataset_identity(Bank(other))["sha256"] != ds["sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("table", ["edges", "edge_segments"])
def test_a_deleted_part_is_recomputed_alone(tmp_path: Path, files: tuple[Path, Path], cli: Callable,
                                            table: str) -> None:
    """Index twice with an append between, then delete the newest part of either table: the next index
    recomputes exactly that unit's rows (the old segments stay), and the edges are those of before."""
    a, b = files
    bank = tmp_path / "bank"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(bank))
    cli("index", str(bank), *_config(bank))
    old_parts = set(Bank(bank).parts("edges"))
    written = {p: (bank / "edges" / f"{p}.parquet").stat().st_mtime_ns for p in old_parts}
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(bank), *_config(bank))
    want = _edges(bank)
    new_parts = sorted(set(Bank(bank).parts("edges")) - old_parts)
    assert new_parts and old_parts <= set(Bank(bank).parts("edges"))
    (bank / table / f"{new_parts[0]}.parquet").unlink()
    out = cli("index", str(bank), *_config(bank))
    assert "associate" in out.stderr + out.stdout
    assert _edges(bank) == want
    assert old_parts <= set(Bank(bank).parts("edges"))
    assert set(Bank(bank).parts("edges")) == set(Bank(bank).parts("edge_segments"))
    assert {p: (bank / "edges" / f"{p}.parquet").stat().st_mtime_ns for p in old_parts} == written, \
        "the old segments were computed again"


@pytest.mark.slow
def test_a_reordering_append_recomputes_from_the_inserted_session(tmp_path: Path, files: tuple[Path, Path],
                                                                  cli: Callable) -> None:
    """A session dated inside h0's history (``--allow-reorder``) shifts every later position: h0's stored
    segment is stale and h0 is associated again from session 0, h1's segment stays, and the edges equal
    one build over the reordered data."""
    a, _ = files
    early = _session(0, 20)
    early.update(session_id="h0early", date="2024-01-03 12:00")  # between h0s1 and h0s2
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"history_id": "h0", "speakers": ["user", "assistant"], "sessions": [early],
                             "questions": []}) + "\n")
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--allow-reorder", "--out", str(grown))
    cli("index", str(grown), *_config(grown))
    assert _segments(grown) == [("h0", 0, 10), ("h1", 0, 7)]
    cli("ingest", str(a), "--format", "jsonl", "--out", str(fresh))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--allow-reorder", "--out", str(fresh))
    cli("index", str(fresh), *_config(fresh))
    assert _edges(grown) == _edges(fresh)


@pytest.mark.slow
def test_one_history_cut_into_several_units_gives_the_same_edges(tmp_path: Path, files: tuple[Path, Path],
                                                                 cli: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    """A history whose new rows are more causal work than one unit holds is associated as several units
    (one Ray task each in a cluster): the segments are its row blocks, and the edges equal one unit's."""
    from memgas.pipeline.association import segments

    a, b = files
    one, cut = tmp_path / "one", tmp_path / "cut"
    for bank in (one, cut):
        cli("ingest", str(a), "--format", "jsonl", "--out", str(bank))
        cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(one), *_config(one))
    monkeypatch.setattr(segments, "UNIT_WORK", segments.causal_work(0, 13) // 3)
    monkeypatch.setattr(segments, "TILE_SESSIONS", 1)
    cli("index", str(cut), *_config(cut))
    h0 = [s for s in _segments(cut) if s[0] == "h0"]
    assert len(h0) == 3 and h0[0][1] == 0 and h0[-1][2] == 13, h0
    assert _edges(cut) == _edges(one)


def _bank_files(bank: Path) -> dict[str, bytes]:
    from memgas.pipeline.locks import LOCK

    return {str(f.relative_to(bank)): f.read_bytes() for f in sorted(bank.rglob("*")) if f.is_file() and f.name != LOCK}


def test_run_refuses_a_grown_bank_and_loses_nothing(tmp_path: Path, files: tuple[Path, Path], cli: Callable) -> None:
    """`memgas run` with `data.path` naming the base file and `bank_dir` a bank grown by
    `ingest --append` re-ingested the base file, exit 0: every appended session and question was gone. A
    bank's data only grows through `memgas ingest`: `run` refuses a grown bank (whatever its data.path) with
    one line naming the commands to use, exit 2, before any work, the bank and run directory untouched."""
    a, b = files
    bank, out = tmp_path / "bank", tmp_path / "run"
    cli("ingest", str(a), "--format", "jsonl", "--out", str(bank))
    cli("ingest", str(b), "--format", "jsonl", "--append", "--out", str(bank))
    before = _bank_files(bank)
    for data in (a, b):
        p = cli("run", str(REPO / "configs" / "demo.yaml"), "--no-ray", *CONFIG, "--set", f"data.path={data}",
                "--set", "data.format=jsonl", "--set", f"bank_dir={bank}", "--set", f"output_dir={out}", check=False)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "1 appended file (b.jsonl)" in p.stderr and f"memgas index {bank} --config" in p.stderr, p.stderr
        assert f"memgas answer {bank} --config" in p.stderr and "new directory" in p.stderr, p.stderr
        assert _bank_files(bank) == before
        assert not out.exists()
    # a plain ingest would replace the appends as well: refused unless --replace says so
    p = cli("ingest", str(a), "--format", "jsonl", "--out", str(bank), check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "grown by 1 append(s)" in p.stderr and "--append" in p.stderr and "--replace" in p.stderr, p.stderr
    assert _bank_files(bank) == before
    cli("ingest", str(a), "--format", "jsonl", "--out", str(bank), "--replace")
    assert Bank(bank).count("sessions") == 9 + 7  # a's sessions only: the bank starts over from a
    assert [d.get("kind") for d in Bank(bank).manifest["datasets"]].count("append") == 0


def _rows(bank: Path, table: str) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True, default=str) for r in Bank(bank).read(table).to_pylist())


def _follow(cli: Callable, cmd: list[str], bank: Path, run: Path) -> subprocess.CompletedProcess:
    """``memgas answer`` until it succeeds, each time running the command its one-line error names (which
    must succeed): `memgas index` with the same config, or the ingest (and appends) it spells out."""
    for _ in range(3):
        p = cli("answer", str(bank), *_config(bank), "--out", str(run), check=False)
        if p.returncode == 0:
            return p
        line = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and line.startswith("memgas answer: error:"), (cmd, p.returncode, p.stderr[-1500:])
        ingests = re.findall(r"memgas ingest (\S+) (--format \S+.*?) --out ([^\s,]+)", line)
        if "run `memgas index`" in line:
            cli("index", str(bank), *_config(bank))
        elif ingests:
            for path, opts, out in ingests:
                assert Path(out) == bank, line
                cli("ingest", path, *opts.split(), "--out", out)
        else:
            raise AssertionError(f"{cmd}: the error names no command that rebuilds: {line}")
    raise AssertionError(f"{cmd}: still refused after the commands it named: {p.stderr[-1500:]}")


@pytest.mark.slow
def test_every_damaged_part_is_rebuilt_by_the_command_the_error_names(tmp_path: Path, built: dict[str, Any],
                                                                       cli: Callable) -> None:
    """After an append, a damaged (unreadable) pre-append `edge_segments` part trapped the user:
    `answer` said "run `memgas index`", which logged "altered; rebuilding it" and then stopped on the
    unreadable part (exit 2, "delete it and re-run"). For one part of every table of the bank (the oldest:
    written before the append) and of the run's results: the command the error names rebuilds it, and the
    bank's rows and the rankings' bytes equal those before the damage."""
    ref, ref_run = built["grown"], built["run_grown"]
    ingest = {"histories", "sessions", "texts", "turns", "pairs", "queries"}
    tables = [t for t in Bank(ref).tables() if t not in ingest or t in ("queries", "texts")]  # ingest tables are one unit
    assert {"generations", "nodes", "embeddings", "edges", "edge_segments", "texts"} <= set(tables), tables
    # the rows of every table; edge_segments only says which rows each edges part holds: a history whose
    # first segment was rebuilt is associated again from session 0 as one segment, as a fresh index does
    compared = [t for t in Bank(ref).tables() if t != "edge_segments"]
    want = {t: _rows(ref, t) for t in compared}
    want_rankings = _part_bytes(ref_run / "results", "rankings")
    results = [("results", t) for t in Bank(ref_run / "results").tables()]
    bank, run = tmp_path / "bank", tmp_path / "run"
    for where, table in [("bank", t) for t in tables] + results:
        if where == "bank" or not bank.exists():
            shutil.rmtree(bank, ignore_errors=True)
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(ref, bank)
        store = bank if where == "bank" else run / "results"
        if where == "results" and not run.exists():
            cli("answer", str(bank), *_config(bank), "--out", str(run))
        parts = Bank(store).parts(table)
        if table == "texts":  # a part ingest did not write (derived texts): ingest's is the queries case
            parts = [p for p in parts if not p.startswith("ingest-")]
        old = [p for p in parts if p in built["parts_before"].get(table, ())] if where == "bank" else []
        part = (old or parts)[0]
        f = store / table / f"{part}.parquet"
        f.write_bytes(b"\0not parquet" * (f.stat().st_size // 12 + 1))
        _follow(cli, [where, table, part], bank, run)
        assert {t: _rows(bank, t) for t in compared} == want, (where, table, part)
        assert _part_bytes(run / "results", "rankings") == want_rankings, (where, table, part)


def _parts_state(results: Path, table: str) -> dict[str, tuple[int, bytes]]:
    """{part: (mtime_ns, bytes)} of a results table's Parquet files."""
    return {p: ((results / table / f"{p}.parquet").stat().st_mtime_ns, (results / table / f"{p}.parquet").read_bytes())
            for p in Bank(results).parts(table)}


def _histories_of(results: Path, part: str) -> set[str]:
    t = Bank(results).read("rankings", ["query_id"], parts=[part])
    return {q.split(":")[0] for q in t["query_id"].to_pylist()}


@pytest.mark.slow
@pytest.mark.parametrize("methods", ["[session,memgas,memgas-no-gmm]", "[memgas,cards,justmem]"])
def test_answer_after_an_append_ranks_only_the_changed_histories(tmp_path: Path, built: dict[str, Any],
                                                                files: tuple[Path, Path], cli: Callable,
                                                                cli_process: Callable, methods: str) -> None:
    """After `ingest --append` + `index`, `memgas answer` into the same run directory ranks only the
    questions of the histories whose sessions or questions changed (and new ones); the rankings parts of
    the others stay as they were (same files: mtimes and bytes). What it keeps and ranks equals a fresh
    answer of a fresh ingest of the whole, byte for byte (rows, part files, retrieval metrics), for the
    MemGAS ranker and the JustMem card ranker; run_record.json and report.md say what was ranked and kept.
    The MemGAS case is killed (SIGKILL) after its first unit and resumed: the plan it made is finished."""
    a, b = files
    config = [*_config(tmp_path), "--set", f"retrieval.methods={methods}"]
    bank, run = tmp_path / "bank", tmp_path / "run"
    shutil.copytree(built["grown"], bank)
    cli("index", str(bank), *config)
    cli("answer", str(bank), *config, "--out", str(run))
    before = _parts_state(run / "results", "rankings")
    kept = {p: s for p, s in before.items() if _histories_of(run / "results", p) <= {"h0", "h1"}}
    assert kept and len(kept) < len(before), sorted(before)
    # C: more sessions and a question for h2, a new history h3; h0 and h1 are untouched
    c = _file(tmp_path / "c.jsonl", {2: range(8, 11), 3: range(0, 7)}, {2: [10], 3: [2]})
    cli("ingest", str(c), "--format", "jsonl", "--append", "--out", str(bank))
    cli("index", str(bank), *config)
    if "justmem" not in methods:  # killed after its first unit, then resumed: the plan it made is kept
        p = cli_process("answer", str(bank), *config, "--out", str(run), check=False,
                        env={"MEMGAS_FAULT": "kill@rank:unit-done#1"})
        assert p.returncode == -9, (p.returncode, p.stderr[-1500:])
    cli("answer", str(bank), *config, "--out", str(run))
    after = _parts_state(run / "results", "rankings")
    assert {p: after.get(p) for p in kept} == kept, "a ranking of an unchanged history was written again"
    rankers = [e for e in json.loads((run / "run_record.json").read_text())
               if e["stage"] in ("rank", "card-rank") and e["status"] != "disabled"]
    assert len(rankers) == (2 if "justmem" in methods else 1), rankers
    for e in rankers:  # h0: 3 questions, h1: 2; h2: 2 + 1, h3: 1
        assert (e["status"], e["histories_ranked"], e["questions_ranked"], e["histories_kept"],
                e["questions_kept"]) == ("executed", 2, 4, 2, 5), e
        resumed = e["stage"] == "rank" and "justmem" not in methods
        assert (e["units_total"], e["units_done"], e["units_resumed"]) == ((2, 1, 1) if resumed else (2, 2, 0)), e
    report = (run / "report.md").read_text()
    for e in rankers:
        assert f"{e['stage']}: ranked 4 questions of 2 histories; kept 5 questions of 2 unchanged histories" in report
    # the same data as one file, ingested fresh (the copied caches spare the encoder), indexed, answered
    records: dict[str, dict] = {}
    for f in (a, b, c):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            have = records.setdefault(r["history_id"], {**r, "sessions": [], "questions": []})
            have["sessions"] += r["sessions"]
            have["questions"] += r["questions"]
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    fresh, fresh_run = tmp_path / "fresh", tmp_path / "fresh_run"
    shutil.copytree(bank, fresh)
    cli("ingest", str(one), "--format", "jsonl", "--replace", "--out", str(fresh))
    cli("index", str(fresh), *config)
    cli("answer", str(fresh), *config, "--out", str(fresh_run))
    assert _rankings(run) == _rankings(fresh_run)
    for table in ("rankings", "card_picks"):
        got = sorted(s[1] for s in _parts_state(run / "results", table).values()) if (run / "results" / table).exists() else []
        want = sorted(s[1] for s in _parts_state(fresh_run / "results", table).values()) \
            if (fresh_run / "results" / table).exists() else []
        assert got == want and (bool(got) == (table == "rankings" or "justmem" in methods)), table
    m = [json.loads((r / "metrics.json").read_text()) for r in (run, fresh_run)]
    assert m[0]["n_queries"] == m[1]["n_queries"] == 9
    assert json.dumps(m[0]["retrieval"]).encode() == json.dumps(m[1]["retrieval"]).encode()


@pytest.mark.slow
def test_answer_with_a_method_the_bank_was_not_indexed_for_names_the_setting(tmp_path: Path, built: dict[str, Any],
                                                                            cli: Callable) -> None:
    """`answer --method memgas-cards` on a bank indexed without it said "run `memgas index` with the same
    config", whose index skipped everything (memgas-cards is not in the config's list), and the answer was
    refused again. The one line names the setting; the index it spells out makes the answer work."""
    bank = tmp_path / "bank"
    shutil.copytree(built["grown"], bank)
    cmd = ["answer", str(bank), *_config(bank), "--method", "memgas-cards", "--out", str(tmp_path / "run")]
    p = cli(*cmd, check=False)
    line = p.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"memgas answer: error: (.*): stage '([a-z-]+)' was not run with this config \(fingerprint "
                     r"[0-9a-f]+\); (.*)", line)
    assert p.returncode == 2 and m and m[1] == str(bank), (p.returncode, p.stderr[-1500:])
    assert m[3] == ("the bank was indexed for retrieval.methods ['session', 'memgas', 'memgas-no-gmm'], without "
                    "['memgas-cards']: add them to the config's retrieval.methods and run `memgas index` with it "
                    "(`--set retrieval.methods=[session,memgas,memgas-no-gmm,memgas-cards]`)"), line
    cli("index", str(bank), *_config(bank), "--set", "retrieval.methods=[session,memgas,memgas-no-gmm,memgas-cards]")
    cli(*cmd)

"""``bench_huge_history.py --through-job`` on a tiny history (64 sessions, 8 appended, 8 questions), commands
in-process and without Ray: the mode runs end to end through the job (IVF association with its recall, the
saved index reused by the append, push and exact PPR answers), so it cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_huge_history
        import huge_history_job
    finally:
        sys.path.remove(str(BENCH))
    tmp = tmp_path_factory.mktemp("huge_job")
    # the IVF search past the first 32 sessions (128 nodes), so that 64 sessions exercise it
    args = bench_huge_history.parser().parse_args([
        "--through-job", "--sizes", "64", "--append", "8", "--queries", "8", "--tmp", str(tmp), "--no-ray",
        "--in-process", "--set", "association.ivf_exact_nodes=128", "--set", "association.ivf_nlist=2",
        "--set", "association.ivf_nprobe=1", "--keep"])
    (r,) = huge_history_job.main(args)
    r["work"] = tmp / "n64"
    return r


def test_through_job_index_and_append(result: dict) -> None:
    # the stored data stands for generate, nodes and encode (runner.mark_done): the commands only associate
    done = {"generate": "skipped", "nodes": "skipped", "encode": "skipped", "associate": "executed"}
    for run in ("index", "append_index"):
        assert {k: v for k, v in result[run]["status"].items() if v != "disabled"} == done
    assert result["fill"]["sessions_filled"] == 64
    assert result["fill"]["vectors"] == 64 * 6 + 8  # session, 2 pairs, summary, keywords, hybrid; questions
    assert result["append_fill"]["sessions_filled"] == 8
    a = result["associate"]
    assert a["search"] == "ivf"
    assert a["ivf_recall_rows"] == 4 * 64 - 128  # every row past the exact prefix (fewer than 256)
    assert 0 < a["ivf_recall"] <= 1
    assert result["answer_push"]["association"]["ivf_recall"] == a["ivf_recall"]  # what metrics.json reports
    assert result["append_associate"]["ivf_index_reused"] == 1
    assert result["append_associate"]["ivf_index_rebuilt"] == 0


def test_through_job_queries(result: dict) -> None:
    for ppr in ("push", "exact"):
        assert result[f"latency_{ppr}"]["n"] == 8
        assert result[f"answer_{ppr}"]["rank_s"] > 0
    assert result["push_agreement"]["queries"] == 8
    assert result["append_answer_push"]["rank_s"] > 0
    # the history grew, so its questions are ranked again (the bench's nodes are stored as the stage's part)
    assert result["append_answer_push"]["histories_ranked"] == 1


def test_agreement_one_question_at_a_time(result: dict) -> None:
    """Where the exact answer does not fit (10^6 sessions), the bench compares push with the exact PPR one
    question at a time on the prepared graph (here on the bank after the append, 72 sessions): every question's
    top-10 agrees, as it did between the two answer runs before the append."""
    sys.path.insert(0, str(BENCH))
    try:
        import huge_history_job
    finally:
        sys.path.remove(str(BENCH))
    from memgas.pipeline.config import MemgasConfig

    cfg = MemgasConfig.load(result["work"] / "config.yaml", ["association.search=ivf", "association.ivf_exact_nodes=128",
                                                             "association.ivf_nlist=2", "association.ivf_nprobe=1"])
    got = huge_history_job.agreement_probe(cfg, 8)
    assert got["queries"] == 8 and got["how"] == "one question at a time"
    assert got["top10_equal"] == 8 and result["push_agreement"]["top10_equal"] == 8


def test_a_commands_peak_rss_is_its_own_not_the_benchs(tmp_path: Path) -> None:
    """Linux counts a parent's RSS at fork into a child's ``ru_maxrss``: with 1 GB touched here, a command
    waited on directly reported >= 1 GB. Through the bench's lean parent: the command's own peak."""
    import numpy as np

    sys.path.insert(0, str(BENCH))
    try:
        import huge_history_job
    finally:
        sys.path.remove(str(BENCH))
    held = np.ones(2**30 // 8)  # 1 GiB, every page touched
    got = huge_history_job.command(["--help"], tmp_path / "log")
    assert held.sum() == held.size  # still held while the command ran
    assert 0 < got["maxrss_gb"] < 0.5, got
    assert "usage: memgas" in (tmp_path / "log").read_text()


def test_an_append_with_the_encoder_runs_every_index_stage(tmp_path: Path) -> None:
    """``--append-encoder``: the append is indexed as a user's would be, generate, nodes and encode run by
    `memgas index` (MiniLM embeds exactly the appended sessions' new texts), then associate; the base the bench
    filled is taken as done."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_huge_history
        import huge_history_job
    finally:
        sys.path.remove(str(BENCH))
    from memgas.pipeline.bank import Bank

    args = bench_huge_history.parser().parse_args([
        "--through-job", "--sizes", "64", "--append", "8", "--queries", "8", "--tmp", str(tmp_path), "--no-ray",
        "--in-process", "--answers", "", "--append-encoder", "--set", "association.ivf_exact_nodes=128",
        "--set", "association.ivf_nlist=2", "--set", "association.ivf_nprobe=1", "--keep"])
    (r,) = huge_history_job.main(args)
    assert r["append_fill"] is None
    ran = {k: v for k, v in r["append_index"]["status"].items() if v != "disabled"}
    assert ran == {"generate": "executed", "nodes": "executed", "encode": "executed", "associate": "executed"}
    assert set(r["append_index"]["stages_s"]) == set(ran)
    from memgas.pipeline.encode import query_hash

    bank = Bank(tmp_path / "n64" / "bank")
    # every text a node, a turn pair or a question holds has its vector once: the base's 64 x 6 + 8 the bench
    # wrote, and the appended sessions' new ones (texts the generator repeats embedded once)
    nodes = bank.read("nodes", ["granularity", "text_hash"]).to_pylist()
    texts = {r["text_hash"] for r in nodes if r["granularity"] != "turn"}
    texts |= set(bank.read("pairs", ["text_hash"])["text_hash"].to_pylist())
    texts |= {query_hash(q) for q in bank.read("queries", ["question"])["question"].to_pylist()}
    vectors = bank.read("embeddings", ["text_hash"])["text_hash"].to_pylist()
    assert len(vectors) == len(set(vectors)) and set(vectors) == texts and len(texts) > 64 * 6 + 8
    assert r["append_associate"]["ivf_index_reused"] == 1

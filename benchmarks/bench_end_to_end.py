"""End-to-end benchmark on synthetic LongMemEval-format histories at LME-S and LME-m scale.

Three parts per scale:

1. **ingest**: ``synth`` writes a LongMemEval-format file (a share of distractor sessions drawn from a
   shared pool, as LongMemEval haystacks share sessions), ``ingest`` loads it into a bank. Prints
   session references vs unique sessions (dedup saving = 1 - unique / references) and MB/s, sessions/s.
2. **retrieval stages from stored embeddings**: the models are skipped; deterministic synthetic
   generations (under the default config's LLM-free generator key), their derived texts, the real
   ``build_nodes`` and seeded unit vectors (384-d, a function of the text hash, with a topic + session
   component so similarities look like MiniLM's) are written into the bank with the real schemas. Then the
   real stage functions run through the real executor (Ray tasks; ``--no-ray``: in-process): association
   (the associate stage: GMM and top-k edges) and ranking (the rank stage: every retrieval
   method). Reading/answering (LLM) is not part of this benchmark.
3. **model stages on a sample** (CPU defaults of ``configs/demo.yaml``: LLM-free generator = YAKE +
   MiniLM centroid summaries, MiniLM encoder): ``--sample-sessions`` unique sessions are generated and
   every text they need (session, turn pairs, summary, keywords, hybrid) is encoded; the per-session time
   is extrapolated to the split's unique sessions (what memgas does) vs all session references (what a
   pipeline without deduplication would do).

    export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    python benchmarks/bench_end_to_end.py                       # LME-S scale: 500 questions x 50 sessions
    python benchmarks/bench_end_to_end.py --scale m --questions 20   # LME-m sessions, fewer questions
    python benchmarks/bench_end_to_end.py --scale both --no-ray

The work directory (default a fresh temp dir, removed at the end unless ``--keep``) holds the synthetic
file and the bank; each scale starts from an empty bank.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCALES = {"s": (500, 50), "m": (500, 500)}  # (questions, sessions per history), as LongMemEval-S / -M
DIM = 384
N_TOPICS = 60

for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_k, _v)


@dataclass
class Row:
    stage: str
    items: float
    unit: str
    seconds: float
    note: str = ""

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class Result:
    label: str
    rows: list[Row] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)


# -- deterministic vectors ----------------------------------------------------------------------------
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hash_normals(keys: list[str], dim: int = DIM, salt: int = 0) -> np.ndarray:
    """[n, dim] standard normals that depend only on each hex key (and ``salt``): same hash, same vector."""
    seeds = np.fromiter((int(k[:16], 16) for k in keys), np.uint64, len(keys)) ^ np.uint64(salt)
    out = np.empty((len(keys), dim), np.float32)
    j = np.arange(1, 2 * dim + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    for a in range(0, len(keys), 4096):
        with np.errstate(over="ignore"):
            z = _splitmix(seeds[a : a + 4096, None] * np.uint64(0x2545F4914F6CDD1D) + j[None, :])
        u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
        u1, u2 = u[:, :dim], u[:, dim:]
        out[a : a + 4096] = np.sqrt(-2.0 * np.log(u1)) * np.cos(2 * np.pi * u2)
    return out


def synthetic_vectors(keys: list[str], owners: list[str]) -> np.ndarray:
    """Unit vectors: topic(owner) + 0.9 * session noise(owner) + 0.8 * own noise(key), all from hashes.

    ``owners[i]`` is the session text hash a text belongs to (itself for a session), so the session, turn
    pairs, summary, keywords and hybrid of one session are similar, and sessions of one topic are related.
    Same recipe as ``bench_association.synthetic_history``.
    """
    rng = np.random.default_rng(0)
    topics = rng.normal(size=(N_TOPICS, DIM))
    topics /= np.linalg.norm(topics, axis=1, keepdims=True)
    uo = sorted(set(owners))
    oi = {h: i for i, h in enumerate(uo)}
    onoise = hash_normals(uo, salt=1) / np.sqrt(DIM)
    otopic = np.fromiter((int(h[16:24], 16) % N_TOPICS for h in uo), np.int64, len(uo))
    idx = np.fromiter((oi[o] for o in owners), np.int64, len(owners))
    v = topics[otopic[idx]].astype(np.float32) + 0.9 * onoise[idx] + 0.8 * hash_normals(keys, salt=2) / np.sqrt(DIM)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v.astype(np.float32)


# -- helpers --------------------------------------------------------------------------------------------
def make_cfg(work: Path, shard_size: int):
    from memgas.pipeline.config import MemgasConfig

    return MemgasConfig.load(ROOT / "configs" / "demo.yaml", [
        f"output_dir={work / 'run'}", f"bank_dir={work / 'bank'}", "retrieval.device=cpu",
        "data.format=longmemeval", f"data.path={work / 'synth.json'}", f"ray.shard_size={shard_size}",
        "reading.enabled=false",  # no LLM here; the runner requires the stages after rank to be done or off
    ])


def _fmt_s(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.1f} h"
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s"


def say(msg: str) -> None:
    print(msg, flush=True)


# -- part 1: synth + ingest ------------------------------------------------------------------------------
def part_ingest(res: Result, work: Path, questions: int, sessions: int, reuse: float, seed: int) -> dict:
    from memgas.pipeline.data.synth import synth
    from memgas.pipeline.ingest import ingest

    path = work / "synth.json"
    t0 = time.perf_counter()
    synth(path, questions=questions, sessions_per_history=sessions, reuse_share=reuse, seed=seed)
    t_synth = time.perf_counter() - t0
    mb = path.stat().st_size / 1e6
    say(f"  synth: {questions} questions x {sessions} sessions, {mb:.1f} MB in {t_synth:.1f} s (not timed below)")
    t0 = time.perf_counter()
    summ = ingest(path, "longmemeval", work / "bank", progress=False)
    t_ing = time.perf_counter() - t0
    refs, uniq = summ["sessions"], summ["unique_sessions"]
    res.rows.append(Row("ingest (MB)", mb, "MB", t_ing))
    res.rows.append(Row("ingest (session refs)", refs, "sessions", t_ing))
    res.facts += [
        ("file", f"{mb:.1f} MB, {questions} questions x {sessions} sessions, reuse_share={reuse}"),
        ("session references", f"{refs}"),
        ("unique sessions", f"{uniq}"),
        ("dedup saving (1 - unique/refs)", f"{1 - uniq / max(refs, 1):.1%}"),
        ("unique texts / turn pairs", f"{summ['texts']} / {summ['pairs']}"),
    ]
    say(f"  ingest: {refs} session refs, {uniq} unique ({1 - uniq / max(refs, 1):.1%} saved), {t_ing:.1f} s")
    return summ


# -- part 2: stored embeddings + association + ranking ------------------------------------------------------
def fill_bank(cfg, res: Result) -> dict:
    """Synthetic generations + derived texts, real build_nodes, synthetic embeddings: what `index` stores."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs import runner
    from memgas.jobs.stage import StageContext
    from memgas.jobs.keys import encoder_key, generation_key
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.jobs.stages.encode import EncodeStage
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.encode import query_hash
    from memgas.pipeline.generate import derived_texts, hybrid_text
    from memgas.pipeline.granularity import build_nodes
    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import GENERATIONS, embeddings_schema

    bank = Bank(cfg.bank_path)
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    model, pv = generation_key(ctx)
    enc = encoder_key(ctx)
    t0 = time.perf_counter()
    sess = bank.read("sessions", ["history_id", "session_id", "text_hash"])
    uniq = sorted(set(sess.column("text_hash").to_pylist()))
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(uniq))
    stext = dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))
    rows, owner = [], {}
    for h in uniq:
        topic = int(h[16:24], 16) % N_TOPICS
        s = f"The user and the assistant talk about topic {topic}; session {h[:12]}."
        k = f"topic {topic}; session {h[:8]}; advice; plans"
        for kind, out in (("summary", s), ("keywords", k)):
            rows.append({"text_hash": h, "kind": kind, "model": model, "prompt_version": pv, "output": out,
                         "raw_output": None, "prompt_tokens": None, "completion_tokens": None,
                         "input_truncated": False, "fallback": None, "error": None})
        owner[h] = h
        owner[text_hash(s)] = h
        owner[text_hash(k)] = h
        owner[text_hash(hybrid_text(s, k, stext[h]))] = h
    gens = pa.Table.from_pylist(rows, schema=GENERATIONS)
    bank.write("generations", gens)
    bank.write_part("texts", "derived-bench", derived_texts(gens, stext))
    t_fill = time.perf_counter() - t0

    t0 = time.perf_counter()
    nodes = build_nodes(bank, generator_model=model, prompt_version=pv, write=True)  # the real nodes stage
    t_nodes = time.perf_counter() - t0
    res.rows.append(Row("nodes (build_nodes)", nodes.num_rows, "node rows", t_nodes))

    t0 = time.perf_counter()
    by_key = EncodeStage().needed(ctx)[0]  # sessions, pairs, summary/keyword/hybrid texts, questions
    if list(by_key) != [enc]:
        raise SystemExit(f"bench_end_to_end writes one encoder key ({enc}); this config asks for {list(by_key)}")
    need = by_key[enc]
    pairs = bank.read("pairs", ["session_hash", "text_hash"])
    for sh, ph in zip(pairs.column("session_hash").to_pylist(), pairs.column("text_hash").to_pylist()):
        owner.setdefault(ph, sh)
    # a question belongs to its (first) evidence session, so rankings are not pure noise
    q = bank.read("queries", ["history_id", "question", "evidence_session_ids"]).to_pylist()
    where = {(h, s): th for h, s, th in zip(*(sess.column(c).to_pylist() for c in ("history_id", "session_id", "text_hash")))}
    for r in q:
        ev = [where.get((r["history_id"], e)) for e in (r["evidence_session_ids"] or [])]
        ev = [e for e in ev if e]
        if ev:
            owner.setdefault(query_hash(r["question"]), ev[0])
    owners = [owner.get(h, h) for h in need]
    schema = embeddings_schema(DIM)
    step = 200_000
    for i, a in enumerate(range(0, len(need), step)):
        keys = need[a : a + step]
        vec = synthetic_vectors(keys, owners[a : a + step])
        table = pa.Table.from_arrays([
            pa.array(keys, pa.string()), pa.array([enc] * len(keys), pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1), pa.float32()), DIM),
            pa.array([False] * len(keys), pa.bool_()),
            # synthetic vectors: no tokens were encoded (null = unknown, never a guess)
            pa.nulls(len(keys), pa.int32()), pa.nulls(len(keys), pa.int32()),
        ], schema=schema)
        bank.write_part("embeddings", f"emb-bench-{i:05d}", table, dim=DIM)
    t_emb = time.perf_counter() - t0
    say(f"  stored data: {gens.num_rows} generations, {nodes.num_rows} node rows, {len(need)} vectors "
        f"({len(need) * DIM * 4 / 1e6:.0f} MB) written in {t_fill + t_emb:.1f} s (setup, not a stage)")
    res.facts.append(("stored vectors (synthetic, 384-d)", f"{len(need)} ({len(need) * DIM * 4 / 1e6:.0f} MB)"))
    for name in ("generate", "nodes", "encode"):  # filled above: the runner takes them as done
        runner.mark_done(ctx, name)
    return {"vectors": len(need), "node_rows": nodes.num_rows}


def part_retrieval(cfg, res: Result, use_ray: bool, sessions_per_history: int) -> None:
    from memgas.jobs import main_job, runner
    from memgas.jobs.profiling import Profiler
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.pipeline.bank import Bank

    bank = Bank(cfg.bank_path)
    n_hist = bank.count("histories")
    n_q = bank.count("queries")
    if use_ray:
        import ray

        t0 = time.perf_counter()
        fresh = not ray.is_initialized()
        main_job.start_ray(cfg, True)
        if fresh:
            res.rows.append(Row("ray init (overhead)", 1, "start", time.perf_counter() - t0))
    from memgas.jobs.stage import StageContext

    prof = Profiler()
    ctx = StageContext(cfg, bank, None, use_ray)
    resolve_stage_runtimes(ctx)
    runner.run_stages(ctx, ["associate"], prof)
    st = prof.stages["associate"]
    s0 = -(-cfg.association.min_prior_nodes // 4)
    gmm_rows = n_hist * 4 * max(0, sessions_per_history - s0)
    edges = bank.count("edges")
    res.rows.append(Row("associate (histories)", n_hist, "histories", st.wall_s,
                        f"cpu {st.cpu_s:.0f}s, shard={cfg.ray.shard_size}"))
    res.rows.append(Row("associate (GMM rows)", gmm_rows, "rows", st.wall_s, f"{edges} edges (gmm+topk)"))

    results = Bank.create(Path(cfg.output_dir) / "results")
    rctx = StageContext(cfg, bank, results, use_ray)
    resolve_stage_runtimes(rctx)
    runner.run_stages(rctx, ["rank"], prof)
    st = prof.stages["rank"]
    methods = cfg.retrieval.methods
    res.rows.append(Row("rank (queries, all methods)", n_q, "queries", st.wall_s, f"{len(methods)} methods"))
    res.rows.append(Row("rank (query x method)", n_q * len(methods), "rankings", st.wall_s,
                        f"{results.count('rankings')} rows stored"))


# -- part 3: model stages on a sample ------------------------------------------------------------------------
def part_models(cfg, res: Result, n_sample: int, refs: int, uniq: int, n_queries: int, seed: int) -> None:
    import pyarrow.compute as pc

    from memgas.pipeline.bank import Bank
    from memgas.pipeline.encode import encode_texts
    from memgas.pipeline.generate import derived_texts, generate_for_sessions
    from memgas.pipeline.models.factory import make_encoder
    from memgas.pipeline.prompts import dialogue_kind_for

    bank = Bank(cfg.bank_path)
    hashes = sorted(set(bank.read("sessions", ["text_hash"]).column("text_hash").to_pylist()))
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(hashes), size=min(n_sample, len(hashes)), replace=False).tolist())
    sample = [hashes[i] for i in pick]
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(sample))
    stext = dict(zip(t.column("text_hash").to_pylist(), t.column("text").to_pylist()))
    pairs = bank.read("pairs", ["text_hash"], filter=pc.field("session_hash").isin(sample))
    ph = sorted(set(pairs.column("text_hash").to_pylist()))
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(ph))
    ptext = t.column("text").to_pylist()
    qs = bank.read("queries", ["question"]).column("question").to_pylist()[:100]

    t0 = time.perf_counter()
    encoder = make_encoder(cfg.encoder)
    encoder.encode(["warm-up"])
    t_load = time.perf_counter() - t0
    res.rows.append(Row("model load: MiniLM (overhead)", 1, "load", t_load, f"device={cfg.encoder.device}"))

    kind = dialogue_kind_for("longmemeval")
    items = [(h, stext[h], kind, None) for h in sample]
    t0 = time.perf_counter()
    from memgas.jobs.stage import StageContext
    from memgas.jobs.keys import generation_key
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.pipeline.llm_free import LLMFreeGenerator

    gctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(gctx)
    gens = generate_for_sessions(items, None, cfg.generation, key=generation_key(gctx), llm_free=LLMFreeGenerator())
    derived = derived_texts(gens, stext)
    t_gen = time.perf_counter() - t0
    res.rows.append(Row("generate, LLM-free (sample)", len(sample), "sessions", t_gen, f"{gens.num_rows} outputs"))

    texts = [stext[h] for h in sample] + ptext + derived.column("text").to_pylist()
    t0 = time.perf_counter()
    encode_texts(encoder, texts)
    t_enc = time.perf_counter() - t0
    res.rows.append(Row("encode MiniLM (sample texts)", len(texts), "texts", t_enc,
                        f"{len(texts) / len(sample):.1f} texts/session"))
    t0 = time.perf_counter()
    encode_texts(encoder, qs)
    t_q = time.perf_counter() - t0
    res.rows.append(Row("encode MiniLM (questions)", len(qs), "questions", t_q))

    per = (t_gen + t_enc) / len(sample)
    q_all = t_q / max(len(qs), 1) * n_queries
    with_dedup = per * uniq + q_all
    without = per * refs + q_all
    res.facts += [
        ("model time / session (gen + encode)", f"{per * 1000:.0f} ms on this machine"),
        ("est. model time, unique sessions (memgas)", _fmt_s(with_dedup)),
        ("est. model time, every session reference", _fmt_s(without)),
        ("model-time dedup saving", f"{1 - with_dedup / max(without, 1e-9):.1%} ({without / max(with_dedup, 1e-9):.2f}x)"),
    ]


# -- driver -------------------------------------------------------------------------------------------------
def run_scale(label: str, questions: int, sessions: int, args, base: Path) -> Result:
    res = Result(f"{label}: {questions} questions x {sessions} sessions")
    say(f"\n== {res.label} ==")
    work = base / label
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cfg = make_cfg(work, args.shard_size)
    summ = part_ingest(res, work, questions, sessions, args.reuse_share, args.seed)
    fill_bank(cfg, res)
    part_retrieval(cfg, res, not args.no_ray, sessions)
    if args.sample_sessions > 0:
        part_models(cfg, res, args.sample_sessions, summ["sessions"], summ["unique_sessions"], summ["queries"], args.seed)
    print_result(res)
    return res


def print_result(res: Result) -> None:
    say(f"\n{res.label}")
    say(f"  {'stage':32} {'items':>10} {'unit':>10} {'seconds':>9} {'items/s':>11}  note")
    for r in res.rows:
        items = f"{r.items:.1f}" if r.unit == "MB" else f"{int(r.items)}"
        say(f"  {r.stage:32} {items:>10} {r.unit:>10} {r.seconds:9.2f} {r.rate:11.1f}  {r.note}")
    for k, v in res.facts:
        say(f"  {k:42} {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=["s", "m", "both"], default="s",
                    help="s = 500 questions x 50 sessions (LME-S), m = 500 x 500 (LME-M); default s")
    ap.add_argument("--questions", type=int, default=None, help="override the number of questions")
    ap.add_argument("--sessions", type=int, default=None, help="override sessions per history")
    ap.add_argument("--reuse-share", type=float, default=0.5, help="share of distractors from the shared pool")
    ap.add_argument("--sample-sessions", type=int, default=40,
                    help="unique sessions for the model-stage sample (0 = skip the model part)")
    ap.add_argument("--shard-size", type=int, default=16, help="histories per association/ranking task")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir, removed unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (banks, synthetic files)")
    ap.add_argument("--no-ray", action="store_true", help="run association/ranking in-process")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    base = args.work_dir or Path(tempfile.mkdtemp(prefix="memgas-bench-e2e-"))
    base.mkdir(parents=True, exist_ok=True)
    say(f"work dir: {base}  (executor: {'in-process' if args.no_ray else 'Ray tasks'}, cores: {os.cpu_count()})")
    results = []
    t0 = time.perf_counter()
    try:
        for sc in (["s", "m"] if args.scale == "both" else [args.scale]):
            q, s = SCALES[sc]
            results.append(run_scale(f"LME-{sc}", args.questions or q, args.sessions or s, args, base))
    finally:
        if not args.no_ray:
            from memgas.jobs.executor import shutdown_ray

            shutdown_ray()
        if args.work_dir is None and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if len(results) > 1:
        say("\n== summary ==")
        for r in results:
            print_result(r)
    say(f"\ntotal wall time {time.perf_counter() - t0:.0f} s. Reading/answering (LLM) not included; model "
        "times extrapolated from the sample; retrieval stages ran on synthetic stored embeddings.")


if __name__ == "__main__":
    main()

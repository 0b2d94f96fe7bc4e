"""``bench_huge_history.py --through-job``: one huge history through the job's commands, not library calls.

Per size N (sessions), in a fresh work directory:

1. A memgas JSONL file of ONE history (``h0``): N sessions of four turns (two turn pairs), each text unique,
   and ``--queries`` questions, each with one evidence session; a second file with the next ``--append``
   sessions. ``memgas ingest`` loads the first with the real loader.
2. Stored data instead of the models (so that 10^5+ sessions fit on 2 cores): LLM-free-looking generations,
   their derived texts, the real ``build_nodes``, and seeded node vectors written into ``embeddings`` under
   the config's encoder key; ``runner.mark_done`` for generate, nodes and encode. The vectors are
   :func:`memgas.pipeline.synth_vectors.clustered_nodes` (the library bench's distribution): session p's
   session / pairs / summary / keywords texts get rows ``4p .. 4p+3`` (both pairs row ``4p+1``, so their mean,
   the turn node, is that row), so the history's node matrix is ``clustered_nodes(0, N)``; a question's
   vector is a node of its evidence session plus noise.
3. Measured, each command a subprocess (``os.wait4``: its wall time and the peak RSS of its largest process,
   ``ru_maxrss``; the stage's process-tree peak from the job's own profiler is read from the bank manifest or
   metrics.json):
   - ``memgas index --set association.search=ivf`` (only associate runs): association wall time; candidate
     recall as the stage reports it (its finish stats, ``ivf_recall``);
   - ``memgas answer --set retrieval.ppr=push`` and ``=exact`` (methods: memgas only): the rank stage's wall
     time, the agreement of the two runs' stored top-10 sessions per question;
   - query latency p50/p95: the job's own probe (``jobs/stages/rank.py: ranking_latency``, what ``memgas
     profile`` reports), over every question one at a time (query vector -> router -> seeds -> PPR on the
     stored graph -> session order; each history's PreparedGraph, its node matrix and the CSR of its edges,
     is built once before, not timed, as a query server holds it), per PPR mode;
   - append: ``memgas ingest --append`` of the next sessions, the stored data of the new sessions (setup, as
     in 2, timed apart), ``memgas index`` again (associate over the new rows, the saved IVF index reused),
     then ``memgas answer`` with push again.

    python benchmarks/bench_huge_history.py --through-job --sizes 10000 [--append 1000] [--queries 200]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

for _k, _v in (("RAY_AUTH_MODE", "disabled"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
               ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_k, _v)

HISTORY = "h0"
DIM = 384  # MiniLM's: the config's encoder key names it, and the rank stage reads vectors of this size
QUERY_NOISE = 0.05  # as bench_huge_history.query_latency: a question sits near one node of its evidence
VECTOR_ROWS = 200_000  # vectors per embeddings part the fill writes (and per slice it computes)


# -- the dataset files ------------------------------------------------------------------------------------
def session(p: int) -> dict[str, Any]:
    """Session ``p``: two turn pairs (with one, the pair's text would be the session's, and so its vector),
    texts unique to ``p`` (no deduplication between sessions)."""
    said = (f"In session {p} I talked about my week.", f"Noted for session {p}.",
            f"Session {p} also had a long meeting.", f"Understood, session {p}.")
    return {"session_id": f"s{p}", "turns": [{"role": ("user", "assistant")[i % 2], "content": t}
                                             for i, t in enumerate(said)]}


def question_sessions(n_sessions: int, n_queries: int, seed: int) -> list[int]:
    """The evidence session of each question: seeded, distinct where possible."""
    rng = np.random.default_rng([seed, 7])
    return sorted(rng.choice(n_sessions, n_queries, replace=n_queries > n_sessions).tolist())


def write_history(path: Path, s0: int, s1: int, evidence: list[int]) -> None:
    """One JSONL line: history ``h0``'s sessions ``[s0, s1)`` and one question per entry of ``evidence``."""
    qs = [{"query_id": f"q{i}", "question": f"What did I say in session {p} (question {i})?",
           "evidence_session_ids": [f"s{p}"]} for i, p in enumerate(evidence)]
    with open(path, "w") as f:
        f.write(json.dumps({"history_id": HISTORY, "speakers": ["user", "assistant"],
                            "sessions": [session(p) for p in range(s0, s1)], "questions": qs}))
        f.write("\n")


def write_config(path: Path, work: Path, ray_cpus: int) -> Path:
    """The benchmark's config: the demo's encoder key (no encoder runs), LLM-free generator key, the memgas
    method only, reading off (no LLM)."""
    path.write_text("\n".join([
        "name: huge-history-job", f"output_dir: {work / 'run'}", f"bank_dir: {work / 'bank'}",
        "data:", f"  path: {work / 'a.jsonl'}", "  format: jsonl",
        "encoder:", "  backend: sentence-transformers", "  model: minilm",
        "generation:", "  generator: llm-free",
        "retrieval:", "  device: cpu", "  methods: [memgas]",
        "reading:", "  enabled: false",
        "ray:", f"  num_cpus: {ray_cpus}", "  shard_size: 1", ""]))
    return path


# -- stored data in place of the models ----------------------------------------------------------------------
def fill(cfg: Any, n_topics: int, seed: int) -> dict[str, Any]:
    """Generations, derived texts, nodes and vectors of every session (and question) that has none yet;
    generate, nodes and encode marked done. Returns counts and seconds."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from memgas.jobs import runner
    from memgas.jobs.keys import encoder_key, generation_key
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.jobs.stage import StageContext
    from memgas.jobs.stages.encode import EncodeStage
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.encode import query_hash
    from memgas.pipeline.generate import derived_texts, hybrid_text
    from memgas.pipeline.granularity import build_nodes
    from memgas.pipeline.hashing import text_hash
    from memgas.pipeline.schema import GENERATIONS, embeddings_schema
    from memgas.pipeline.synth_vectors import clustered_nodes

    t0 = time.perf_counter()
    bank = Bank(cfg.bank_path)
    ctx = StageContext(cfg, bank, None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    model, pv = generation_key(ctx)
    enc = encoder_key(ctx)
    sess = bank.read("sessions", ["position", "session_id", "text_hash"]).sort_by("position")
    pos_of = dict(zip(sess["text_hash"].to_pylist(), sess["position"].to_pylist()))
    pos_of_id = dict(zip(sess["session_id"].to_pylist(), sess["position"].to_pylist()))
    have_gen: set[str] = set()
    if bank.exists("generations"):
        have_gen = set(bank.read("generations", ["text_hash"])["text_hash"].to_pylist())
    new = [h for h in sess["text_hash"].to_pylist() if h not in have_gen]
    t = bank.read("texts", ["text_hash", "text"], filter=pc.field("text_hash").isin(new))
    stext = dict(zip(t["text_hash"].to_pylist(), t["text"].to_pylist()))
    rows, row_of = [], {}  # row_of: text hash -> (session position, granularity row 0..3, or 4 = hybrid)
    for h in new:
        p = pos_of[h]
        s, k = f"Summary of session {p}: the user's week.", f"session {p}; week; plans"
        for kind, out in (("summary", s), ("keywords", k)):
            rows.append({"text_hash": h, "kind": kind, "model": model, "prompt_version": pv, "output": out,
                         "raw_output": None, "prompt_tokens": None, "completion_tokens": None,
                         "input_truncated": False, "fallback": None, "error": None})
        row_of.update({h: (p, 0), text_hash(s): (p, 2), text_hash(k): (p, 3),
                       text_hash(hybrid_text(s, k, stext[h])): (p, 4)})
    tag = f"{len(have_gen):09d}"
    if rows:
        gens = pa.Table.from_pylist(rows, schema=GENERATIONS)
        bank.write_part("generations", f"gen-bench-{tag}", gens)
        bank.write_part("texts", f"derived-bench-{tag}", derived_texts(gens, stext))
    # the real nodes stage's rows, stored as the stage stores them: one part named by its fingerprint (the rank
    # stage reads the current part; a part of another name would leave it blind to the appended sessions)
    runner.mark_done(ctx, "generate")
    nodes_stage = next(st for st in ctx.pipeline if st.name == "nodes")
    fp, _ = runner.set_fingerprint(nodes_stage, ctx)
    nodes = build_nodes(bank, generator_model=model, prompt_version=pv)
    bank.write_part("nodes", f"nodes-{fp}-bench", nodes)
    for part in bank.parts("nodes"):
        if part != f"nodes-{fp}-bench":
            bank.drop_part("nodes", part)
    t_gen = time.perf_counter() - t0

    t0 = time.perf_counter()
    by_key, questions = EncodeStage().needed(ctx)
    if list(by_key) != [enc]:
        raise SystemExit(f"huge_history_job writes one encoder key ({enc}); this config asks for {list(by_key)}")
    have = set(bank.read("embeddings", ["text_hash"], filter=pc.field("encoder") == enc)["text_hash"].to_pylist()
               ) if bank.exists("embeddings") else set()
    need = [h for h in sorted(by_key[enc].to_pylist()) if h not in have]  # needed() gives Arrow arrays, unordered
    pairs = bank.read("pairs", ["session_hash", "text_hash"], filter=pc.field("session_hash").isin(new))
    for sh, ph in zip(pairs["session_hash"].to_pylist(), pairs["text_hash"].to_pylist()):
        row_of[ph] = (pos_of[sh], 1)
    q = bank.read("queries", ["query_id", "question", "evidence_session_ids"]).to_pylist()
    q_of = {query_hash(r["question"]): (int(r["query_id"][1:]), pos_of_id[r["evidence_session_ids"][0]]) for r in q}
    if not need:
        return {"sessions_filled": 0, "vectors": 0, "generate_nodes_s": t_gen, "vectors_s": 0.0}
    for h in need:
        if h not in row_of and h not in q_of:
            what = questions.get(h, "not a question")
            raise SystemExit(f"huge_history_job: no synthetic vector for text {h} ({what!r})")
    # the vectors in position order, VECTOR_SESSIONS sessions at a time: at 10^6 sessions the whole matrix and
    # its copy would be ~14 GB in this process (clustered_nodes is the same whatever its slice)
    pos = [row_of[h][0] if h in row_of else q_of[h][1] for h in need]
    order = sorted(range(len(need)), key=pos.__getitem__)
    schema = embeddings_schema(DIM)
    j = 0
    for a in range(0, len(order), VECTOR_ROWS):
        chunk = order[a : a + VECTOR_ROWS]
        lo, hi = pos[chunk[0]], pos[chunk[-1]] + 1
        base = clustered_nodes(lo, hi, dim=DIM, n_topics=n_topics, seed=seed).reshape(hi - lo, 4, DIM)
        vec = np.empty((len(chunk), DIM), np.float32)
        for i, k in enumerate(chunk):
            h = need[k]
            if h in row_of:
                p, g = row_of[h]
                v = base[p - lo, g] if g < 4 else base[p - lo, 0] + base[p - lo, 2]  # hybrid: only its baseline reads it
            else:
                qi, p = q_of[h]
                rng = np.random.default_rng([seed, 11, qi])
                v = base[p - lo, int(rng.integers(4))] + QUERY_NOISE * rng.standard_normal(DIM).astype(np.float32)
            vec[i] = v / np.linalg.norm(v)
        keys = [need[k] for k in chunk]
        table = pa.Table.from_arrays([
            pa.array(keys, pa.string()), pa.array([enc] * len(keys), pa.string()),
            pa.FixedSizeListArray.from_arrays(pa.array(vec.reshape(-1), pa.float32()), DIM),
            pa.array([False] * len(keys), pa.bool_()),
            pa.nulls(len(keys), pa.int32()), pa.nulls(len(keys), pa.int32()),  # no tokens were encoded
        ], schema=schema)
        bank.write_part("embeddings", f"emb-bench-{tag}-{j:05d}", table, dim=DIM)
        j += 1
    for name in ("nodes", "encode"):  # filled above: the runner takes them as done (generate: before the nodes)
        runner.mark_done(ctx, name)
    return {"sessions_filled": len(new), "vectors": len(need), "node_rows": nodes.num_rows,
            "generate_nodes_s": t_gen, "vectors_s": time.perf_counter() - t0}


# -- commands -----------------------------------------------------------------------------------------------
def command(argv: list[str], log: Path, in_process: bool = False) -> dict[str, float | None]:
    """Run ``memgas ARGV`` as a child process; its wall time and ``ru_maxrss`` (its largest process, with the
    descendants it waited for; measured through :data:`_LEAN_PARENT`). Exit on failure, with the tail of its
    log. ``in_process`` (the smoke test: no interpreter start per command): ``cli.main(ARGV)`` here, and no
    RSS of its own."""
    t0 = time.perf_counter()
    if in_process:
        from memgas.jobs.cli import main as cli_main

        code = cli_main(argv)
        if code:
            sys.exit(f"memgas {' '.join(argv)} failed ({code})")
        return {"wall_s": time.perf_counter() - t0, "maxrss_gb": None}
    with open(log, "ab") as f:
        f.write(("$ memgas " + " ".join(argv) + "\n").encode())
        f.flush()
        read_end, write_end = os.pipe()
        try:
            p = subprocess.Popen([sys.executable, "-c", _LEAN_PARENT, str(write_end), sys.executable, "-c",
                                  "import sys; from memgas.jobs.cli import main; sys.exit(main())", *argv],
                                 stdout=f, stderr=subprocess.STDOUT, env=os.environ, pass_fds=(write_end,))
            os.close(write_end)
            code = p.wait()
            maxrss_kib = int(os.read(read_end, 64) or b"0")
        finally:
            os.close(read_end)
    wall = time.perf_counter() - t0
    if code:
        sys.exit(f"memgas {' '.join(argv)} failed ({code}):\n" + log.read_text()[-4000:])
    return {"wall_s": wall, "maxrss_gb": maxrss_kib / 2**20}  # KiB on Linux


#: The command's parent: a bare interpreter that runs it and writes its ``ru_maxrss`` (KiB) to the fd given.
#: Linux counts a parent's RSS at fork into the child's ``ru_maxrss`` (the old mm's high-water mark is kept
#: at exec), so waiting on the command from this process reported the bench's own RSS (gigabytes once its
#: vectors are filled) for every command; through this ~15 MB parent, the command's own peak.
_LEAN_PARENT = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(p.pid, 0); "
                "os.write(int(sys.argv[1]), str(usage.ru_maxrss).encode()); sys.exit(os.waitstatus_to_exitcode(status))")


def latency(cfg: Any, ppr: str, n_queries: int) -> dict[str, float]:
    """The job's per-query probe over ``n_queries`` questions, one at a time, under ``retrieval.ppr=ppr``."""
    from memgas.jobs import runner
    from memgas.jobs.stages import rank
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.jobs.stage import StageContext
    from memgas.pipeline.bank import Bank

    c = cfg.model_copy(update={"retrieval": cfg.retrieval.model_copy(update={"ppr": ppr})})
    ctx = StageContext(c, Bank(c.bank_path), None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    cpu, wall = time.process_time(), time.perf_counter()
    out = rank.ranking_latency(ctx, n_queries=n_queries)
    # CPU seconds of the whole probe (matrices loaded once, then the queries) per query: on shared cores
    # the wall percentiles carry the other processes' load, this does not
    out["probe_cpu_ms_per_query"] = 1e3 * (time.process_time() - cpu) / max(out.get("n", 0), 1)
    out["probe_wall_s"] = time.perf_counter() - wall
    out["loadavg_1m_after"] = os.getloadavg()[0]
    return out


def agreement_probe(cfg: Any, n_queries: int, method: str = "memgas") -> dict[str, Any]:
    """Push PPR's top-10 against the exact PPR's, one question at a time on the prepared graph (the latency
    probe's preparation, ``rank.prepared_questions``), where the exact answer's batch does not fit
    (its ``[Q, 4S]`` iterates). Each question's exact PPR then iterates until its own change is below the
    tolerance, not the whole batch's: the rank stage's exact batch can only iterate more, towards the same
    fixed point."""
    import numpy as np

    from memgas.jobs import runner
    from memgas.jobs.stages import rank
    from memgas.jobs.placement import resolve_stage_runtimes
    from memgas.jobs.stage import StageContext
    from memgas.pipeline.bank import Bank

    ctx = StageContext(cfg, Bank(cfg.bank_path), None, use_ray=False)
    resolve_stage_runtimes(ctx)
    runner.compute_fingerprints(ctx)
    r = cfg.retrieval
    same = n = 0
    wall = time.perf_counter()
    for graph, qv in rank.prepared_questions(ctx, n_queries, method, ["push", "exact"]):
        tops = [graph.rank(qv, [method], num_seeds=r.num_seeds, damping=r.damping, temp=r.temp, router=r.router,
                           ppr=kind, ppr_epsilon=r.ppr_epsilon)[method][0][0, :10] for kind in ("push", "exact")]
        same += bool(np.array_equal(*tops))
        n += 1
    return {"queries": n, "top10_equal": same, "agreement": same / n if n else None,
            "how": "one question at a time", "wall_s": time.perf_counter() - wall}


def top10(run: Path) -> dict[str, list[str]]:
    from memgas.pipeline.bank import Bank

    t = Bank(run / "results").read("rankings", ["method", "query_id", "rank", "session_id"]).to_pylist()
    out: dict[str, list[tuple[int, str]]] = {}
    for r in t:
        if r["method"] == "memgas" and r["rank"] <= 10:
            out.setdefault(r["query_id"], []).append((r["rank"], r["session_id"]))
    return {q: [s for _, s in sorted(v)] for q, v in out.items()}


def agreement(push: Path, exact: Path) -> dict[str, Any]:
    a, b = top10(push), top10(exact)
    same = sum(a.get(q) == v for q, v in b.items())
    return {"queries": len(b), "top10_equal": same, "agreement": same / len(b) if b else None}


def stage_of(metrics: dict[str, Any], name: str) -> dict[str, Any]:
    return metrics.get("stages", {}).get(name, {})


def run_size(S: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from memgas.pipeline.bank import Bank
    from memgas.pipeline.config import MemgasConfig

    work.mkdir(parents=True, exist_ok=True)
    log = work / "commands.log"
    out: dict[str, Any] = {}

    def save() -> None:  # each result as soon as it is measured: a long size stopped midway keeps them
        (work / "partial.json").write_text(json.dumps(out, indent=1) + "\n")

    def cmd(key: str, argv: list[str]) -> None:
        # with the machine's load average (the cores are shared: wall times depend on it)
        out[key] = {**command(argv, log, args.in_process), "loadavg_1m_after": os.getloadavg()[0]}
        save()

    evidence = question_sessions(S, args.queries, args.seed)
    t0 = time.perf_counter()
    write_history(work / "a.jsonl", 0, S, evidence)
    write_history(work / "b.jsonl", S, S + args.append, [])
    out.update({"sessions": S, "appended": args.append, "questions": args.queries,
                "files_s": time.perf_counter() - t0, "ray": not args.no_ray})
    cfg_path = write_config(work / "config.yaml", work, args.ray_cpus)
    bank = str(work / "bank")
    common = ["-c", str(cfg_path), *(["--no-ray"] if args.no_ray else [])]
    ivf = ["--set", "association.search=ivf", *[x for kv in args.set for x in ("--set", kv)]]
    cfg = MemgasConfig.load(cfg_path, [s for s in ivf[1::2]])
    cmd("ingest", ["ingest", str(work / "a.jsonl"), "--format", "jsonl", "--out", bank])
    out["fill"] = fill(cfg, args.topics, args.seed)
    save()
    cmd("index", ["index", bank, *common, *ivf])
    man = Bank(bank).manifest["index"]
    out["index"]["status"] = {e["stage"]: e["status"] for e in man["record"]}  # generate..encode: skipped
    st = man["stages"]["associate"]
    out["associate"] = {"wall_s": st["wall_s"], "tree_peak_rss_gb": st["peak_rss_mb"] / 1024,
                        **{k: st["extra"].get(k) for k in ("edges_gmm", "ivf_recall", "ivf_recall_min_history",
                                                           "ivf_recall_rows", "ivf_index_reused", "search")}}
    save()
    runs = {}
    for ppr in args.answers:
        run = work / f"run-{ppr}"
        cmd(f"answer_{ppr}", ["answer", bank, *common, *ivf, "--set", f"retrieval.ppr={ppr}", "--out", str(run)])
        m = json.loads((run / "metrics.json").read_text())
        rk = stage_of(m, "rank")
        out[f"answer_{ppr}"].update(rank_s=rk.get("wall_s"), rank_tree_peak_rss_gb=rk.get("peak_rss_mb", 0) / 1024,
                                    association=m["run"]["association"], command_probe=m.get("latency"))
        n_lat = args.queries if ppr == "push" or args.exact_latency_queries is None else args.exact_latency_queries
        out[f"latency_{ppr}"] = latency(cfg, ppr, n_lat)
        save()
        runs[ppr] = run
    if len(runs) == 2:
        out["push_agreement"] = agreement(runs["push"], runs["exact"])
        save()
    elif args.agreement_queries:  # no exact answer (it does not fit at 10^6): one question at a time
        out["push_agreement"] = agreement_probe(cfg, args.agreement_queries)
        save()

    cmd("append_ingest", ["ingest", str(work / "b.jsonl"), "--format", "jsonl", "--out", bank, "--append"])
    # --append-encoder: the append as a user's, its generate, nodes and encode run by `memgas index` (the
    # config's encoder, MiniLM on the CPU, embeds its new texts beside the bench's vectors under its key)
    out["append_fill"] = None if args.append_encoder else fill(cfg, args.topics, args.seed)
    save()
    cmd("append_index", ["index", bank, *common, *ivf])
    man = Bank(bank).manifest["index"]
    out["append_index"]["status"] = {e["stage"]: e["status"] for e in man["record"]}
    out["append_index"]["stages_s"] = {e["stage"]: round(man["stages"][e["stage"]]["wall_s"], 2)
                                       for e in man["record"] if e["status"] == "executed"}
    st = man["stages"]["associate"]
    out["append_associate"] = {"wall_s": st["wall_s"], "tree_peak_rss_gb": st["peak_rss_mb"] / 1024,
                               **{k: st["extra"].get(k)
                                  for k in ("ivf_recall", "ivf_index_reused", "ivf_index_rebuilt", "ivf_found_units")}}
    out["append_s"] = out["append_ingest"]["wall_s"] + out["append_index"]["wall_s"]
    save()
    if "push" not in runs:
        return out
    cmd("append_answer_push",
        ["answer", bank, *common, *ivf, "--set", "retrieval.ppr=push", "--out", str(runs["push"])])
    m = json.loads((runs["push"] / "metrics.json").read_text())
    out["append_answer_push"]["rank_s"] = stage_of(m, "rank").get("wall_s")
    rank = [e for e in json.loads((runs["push"] / "run_record.json").read_text()) if e["stage"] == "rank"]
    out["append_answer_push"]["histories_ranked"] = rank[0].get("histories_ranked") if rank else None
    save()
    return out


def table(results: list[dict[str, Any]]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else (f"{x / 60:.1f} min" if x >= 120 else f"{x:.1f} s")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    lines = ["| sessions | association (index cmd / associate stage) | append 1k (ingest --append + index) | "
             "query p50 / p95 push | query p50 / p95 exact | rank stage push / exact | peak RSS index / answer "
             "push / answer exact / append index | recall@30 | push top-10 agreement |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        none: dict[str, Any] = {"rank_s": None, "maxrss_gb": None}
        r = {"latency_push": {}, "latency_exact": {}, "push_agreement": {"top10_equal": "-", "queries": "-"},
             "answer_push": none, "answer_exact": none, **r}
        lp, le, ag = r["latency_push"], r["latency_exact"], r["push_agreement"]
        rss = " / ".join("-" if r[k]["maxrss_gb"] is None else f"{r[k]['maxrss_gb']:.2f}"
                         for k in ("index", "answer_push", "answer_exact", "append_index"))
        lines.append(
            f"| {r['sessions']:,} | {s(r['index']['wall_s'])} / {s(r['associate']['wall_s'])} | "
            f"{s(r['append_s'])} ({s(r['append_ingest']['wall_s'])} + {s(r['append_index']['wall_s'])}) | "
            f"{lp.get('p50_ms', 0):.0f} / {lp.get('p95_ms', 0):.0f} ms ({lp.get('n')} q) | "
            f"{le.get('p50_ms', 0):.0f} / {le.get('p95_ms', 0):.0f} ms ({le.get('n')} q) | "
            f"{s(r['answer_push']['rank_s'])} / {s(r['answer_exact']['rank_s'])} | "
            f"{rss} GB | {pct(r['associate']['ivf_recall'])} | {ag['top10_equal']}/{ag['queries']} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    import shutil
    import tempfile

    if set(args.answers) - {"push", "exact"}:
        raise SystemExit(f"--answers: push and/or exact, not {','.join(args.answers)!r}")
    base = Path(args.tmp or tempfile.mkdtemp(prefix="memgas-huge-job-"))
    results = []
    try:
        for S in [int(x) for x in args.sizes.split(",")]:
            t = time.perf_counter()
            r = run_size(S, args, base / f"n{S}")
            r["bench_wall_s"] = time.perf_counter() - t
            results.append(r)
            print(json.dumps(r), flush=True)
            if not args.keep:
                shutil.rmtree(base / f"n{S}", ignore_errors=True)
    finally:
        if not args.keep and not args.tmp:
            shutil.rmtree(base, ignore_errors=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--through-job")
    g.add_argument("--no-ray", action="store_true", help="--through-job: the commands run with --no-ray")
    g.add_argument("--ray-cpus", type=int, default=2, help="--through-job: ray.num_cpus")
    g.add_argument("--set", action="append", default=[],
                   help="--through-job: KEY=VALUE for index and answer (e.g. association.ivf_exact_nodes=8192)")
    g.add_argument("--exact-latency-queries", type=int, default=None,
                   help="--through-job: questions in the exact PPR's latency probe (default: all; each one "
                        "builds the graph and runs PPR over all of it: seconds at 10^5 sessions)")
    g.add_argument("--answers", type=lambda v: [x for x in v.split(",") if x], default=["push", "exact"],
                   help="--through-job: the `memgas answer` runs, comma-separated among push,exact (agreement "
                        "needs both; '' = none: association and append only)")
    g.add_argument("--agreement-queries", type=int, default=0,
                   help="--through-job: without both answers, compare push with the exact PPR on this many "
                        "questions, one at a time on the prepared graph (0: not measured)")
    g.add_argument("--append-encoder", action="store_true",
                   help="--through-job: the append's generate, nodes and encode run in `memgas index` (the "
                        "config's encoder embeds the new texts), not the bench's fill: a whole append as a "
                        "user's, whose time includes the encoder's")
    g.add_argument("--seed", type=int, default=0, help="--through-job: questions' sessions and vectors")
    g.add_argument("--in-process", action="store_true",
                   help="--through-job: run the commands in this process (quick; no per-command RSS)")
    g.add_argument("--keep", action="store_true", help="--through-job: keep the work directory")

"""memgas-cards' router on a finished run: how much weight the cards get, under each
``retrieval.card_graph_entropy``.

    .venv/bin/python benchmarks/memgas_cards_router.py RUN_DIR

RUN_DIR: the output_dir of a `memgas run` that ranked memgas-cards (its bank, results, config.yaml and
metrics.json). Rebuilds each history's five-granularity graph and reads the run's card-graph edges, then, for
"raw" (each granularity's router entropy H_g, MemGAS's rule) and "normalised" (H_g / log N_g), prints the mean
router weight of each granularity, the share of PPR's reset mass on the cards, and memgas-cards' session-level
metrics (the job's metric code, pipeline/evaluate/retrieval.py: R_all@3/5/10, NDCG@10 overall and R_all@5 per
question type). The run's own setting is marked; its row equals metrics.json's (a check that the rebuilt
graph is the run's). Nothing is written: the other setting is what `--set retrieval.card_graph_entropy=...`
would rank (card-graph-rank only re-runs). Exit 1 if the run's own row differs from metrics.json's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from memgas.jobs import stages as S
from memgas.jobs import tables
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.runner import active_of
from memgas.jobs.stage import Stage, StageContext
from memgas.jobs.stages.card_graph import history_card_graph
from memgas.kernels import router as R
from memgas.pipeline.bank import Bank
from memgas.pipeline.card_graph import CARD, rank_card_graph
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.evaluate.retrieval import aggregate_retrieval, score_retrieval
from memgas.pipeline.retrieve import seed_reset
from memgas.pipeline.schema import CARD_GRAPH_GRANULARITIES

SETTINGS = ("raw", "normalised")
KS = (3, 5, 10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the output_dir of a memgas run that ranked memgas-cards")
    run = ap.parse_args(argv).run
    cfg = MemgasConfig.load(run / "config.yaml", [])
    ctx = StageContext(cfg, Bank(run / "bank"), Bank(run / "results"), use_ray=False, pipeline=S.PIPELINE)
    resolve_stage_runtimes(ctx)
    metrics = json.loads((run / "metrics.json").read_text())
    ctx.fingerprints.update(metrics["run"]["fingerprints"])
    # a segmented table's parts are named by its writer's key (its config), which the run does not record
    for step in S.PIPELINE:
        if isinstance(step, Stage) and step.writes and step.writes[0].kind == "segmented":
            active = active_of(step, ctx)
            if active is not None:
                ctx.keys[step.name] = tables.stage_key(step, ctx, active)
    queries = {r["query_id"]: r for r in ctx.bank.read(
        "queries", ["query_id", "evidence_session_ids", "is_abstention", "question_type"]).to_pylist()}
    edges = tables.read_current(ctx, "card_graph_edges").to_pandas()
    r = cfg.retrieval
    weights = {s: [] for s in SETTINGS}
    card_mass = {s: [] for s in SETTINGS}
    records = {s: [] for s in SETTINGS}
    for h, g, sids, qids, qv in history_card_graph(ctx):
        sims = qv.astype(np.float64) @ g.nodes.astype(np.float64).T
        e = edges[edges["history_id"] == h]
        src, dst = e["src"].to_numpy(np.int64), e["dst"].to_numpy(np.int64)
        for s in SETTINGS:
            w, _ = R.entropy_router([sims[:, g.gran == i] for i in range(len(CARD_GRAPH_GRANULARITIES))],
                                    temp=r.temp, rule=r.router, normalise=s == "normalised")
            reset = seed_reset(sims * w[:, g.gran], r.num_seeds)
            weights[s].append(w)
            card_mass[s].append(reset[:, g.gran == CARD].sum(1) / np.maximum(reset.sum(1), 1e-300))
            order, _ = rank_card_graph(g, qv, src, dst, num_seeds=r.num_seeds, damping=r.damping, temp=r.temp,
                                       router=r.router, ppr=r.ppr, ppr_epsilon=r.ppr_epsilon, entropy=s)
            for qi, qid in enumerate(qids):
                q = queries[qid]
                records[s].append({"query_id": qid, "ranked_ids": [sids[i] for i in order[qi, :r.store_top]],
                                   "evidence_ids": list(q["evidence_session_ids"] or []),
                                   "is_abstention": bool(q["is_abstention"]), "question_type": q["question_type"]})
    same = None
    for s in SETTINGS:
        mark = " (the run's setting)" if s == r.card_graph_entropy else ""
        w = np.concatenate(weights[s]).mean(0)
        print(f"== {s}{mark}")
        print("  mean router weights:", ", ".join(f"{n} {x:.3f}" for n, x in zip(CARD_GRAPH_GRANULARITIES, w)))
        print(f"  share of the reset's mass on cards: {float(np.concatenate(card_mass[s]).mean()):.3f}")
        per_q, _ = score_retrieval(records[s], KS)
        agg = aggregate_retrieval(per_q)
        o = agg.loc["overall"]
        print(f"  {int(o['n'])} questions: R_all@3 {100 * o['recall_all@3']:.1f}, R_all@5 {100 * o['recall_all@5']:.1f}, "
              f"R_all@10 {100 * o['recall_all@10']:.1f}, NDCG@10 {100 * o['ndcg@10']:.1f}")
        for t, row in agg.drop(index="overall").iterrows():
            print(f"    {t}: n {int(row['n'])}, R_all@5 {100 * row['recall_all@5']:.1f}, NDCG@10 {100 * row['ndcg@10']:.1f}")
        if mark:
            ran = metrics["retrieval"]["session"]["memgas-cards"]["overall"]
            keys = ("n", "recall_all@3", "recall_all@5", "recall_all@10", "ndcg@10")
            same = all(float(o[k]) == float(ran[k]) for k in keys)
    print(f"the run's setting equals metrics.json's memgas-cards row: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""memgas-cards' router on a finished run (issue 28 item 6): how much weight the cards get, and a variant.

    .venv/bin/python benchmarks/memgas_cards_router.py RUN_DIR

RUN_DIR: the output_dir of a `memgas run` that ranked memgas-cards (its bank, results, config.yaml and
metrics.json). Rebuilds each history's five-granularity graph and reads the run's card-graph edges, then
prints the mean router weight of each granularity, the share of PPR's reset mass on the cards, and R_all@5
and R_all@10 (questions with evidence sessions) of memgas-cards as shipped and with each granularity's
entropy divided by log(N_g), its maximum. Under the paper rule that division changes no weight of the four
MemGAS granularities (all have N_g = S) and lifts the cards, whose many nodes make their softmax flat.
The variant is measured only, not a method: docs/benchmarks.md, "memgas-cards".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from memgas.jobs import stages as S
from memgas.jobs import tables
from memgas.jobs.placement import resolve_stage_runtimes
from memgas.jobs.stage import StageContext
from memgas.jobs.stages.card_graph import history_card_graph
from memgas.kernels import router as R
from memgas.pipeline.bank import Bank
from memgas.pipeline.card_graph import CARD, rank_card_graph
from memgas.pipeline.config import MemgasConfig
from memgas.pipeline.retrieve import seed_reset
from memgas.pipeline.schema import CARD_GRAPH_GRANULARITIES

_entropy = R._entropy


def _normalised(xp, s, mask, temp):  # noqa: ANN001, ANN202  (the kernel's private signature)
    return _entropy(xp, s, mask, temp) / np.log(np.maximum(mask.sum(axis=-1), 2))


def main(run: Path) -> None:
    cfg = MemgasConfig.load(run / "config.yaml", [])
    ctx = StageContext(cfg, Bank(run / "bank"), Bank(run / "results"), use_ray=False, pipeline=S.PIPELINE)
    resolve_stage_runtimes(ctx)
    ctx.fingerprints.update(json.loads((run / "metrics.json").read_text())["run"]["fingerprints"])
    evidence = {r["query_id"]: set(r["evidence_session_ids"] or [])
                for r in ctx.bank.read("queries", ["query_id", "evidence_session_ids"]).to_pylist()}
    edges = tables.read_current(ctx, "card_graph_edges").to_pandas()
    r = cfg.retrieval
    weights, card_mass, hits = [], [], {"shipped": [], "entropy / log N_g": []}
    for h, g, sids, qids, qv in history_card_graph(ctx):
        sims = qv.astype(np.float64) @ g.nodes.astype(np.float64).T
        w, _ = R.entropy_router([sims[:, g.gran == i] for i in range(len(CARD_GRAPH_GRANULARITIES))],
                                temp=r.temp, rule=r.router)
        reset = seed_reset(sims * w[:, g.gran], r.num_seeds)
        weights.append(w)
        card_mass.append(reset[:, g.gran == CARD].sum(1) / np.maximum(reset.sum(1), 1e-300))
        e = edges[edges["history_id"] == h]
        src, dst = e["src"].to_numpy(np.int64), e["dst"].to_numpy(np.int64)
        for name in hits:
            R._entropy = _normalised if name != "shipped" else _entropy
            try:
                order, _ = rank_card_graph(g, qv, src, dst, num_seeds=r.num_seeds, damping=r.damping, temp=r.temp,
                                           router=r.router)
            finally:
                R._entropy = _entropy
            for qi, qid in enumerate(qids):
                if evidence[qid]:
                    top = [sids[i] for i in order[qi]]
                    hits[name].append((evidence[qid] <= set(top[:5]), evidence[qid] <= set(top[:10])))
    w = np.concatenate(weights).mean(0)
    print("mean router weights:", ", ".join(f"{n} {x:.3f}" for n, x in zip(CARD_GRAPH_GRANULARITIES, w)))
    print(f"share of the reset's mass on cards: {float(np.concatenate(card_mass).mean()):.3f}")
    for name, v in hits.items():
        a = 100 * np.array(v, float).mean(0)
        print(f"{name}: {len(v)} questions, R_all@5 {a[0]:.1f}, R_all@10 {a[1]:.1f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The registry of retrieval methods: the one place that says which methods exist and what each needs.

Every other module (config validation, the ranking stage, evaluation, reports) asks this registry
instead of keeping its own list, so a new method is one row here plus its scoring code in
:mod:`memgas.pipeline.retrieve`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    #: single-granularity methods: the node row they rank by ("session", "turn", ..., "hybrid")
    granularity: str | None = None
    #: graph methods: which stored edges they spread over ("gmm", "topk"), or None (no graph)
    edges: str | None = None
    #: graph methods only: Personalized PageRank over the edges (False: weighted node scores summed)
    ppr: bool = True
    #: graph methods only: entropy-router weights (False: equal weights 1/4)
    router: bool = True
    description: str = ""

    @property
    def is_graph(self) -> bool:
        """Methods scored from the four MemGAS node granularities (router, seeds, PPR)."""
        return self.granularity is None


_ALL = (
    Method("session", granularity="session", description="session text embedding"),
    Method("turn", granularity="turn", description="mean of the session's turn-pair embeddings"),
    Method("summary", granularity="summary", description="summary embedding"),
    Method("keyword", granularity="keyword", description="keyword-list embedding"),
    Method("hybrid", granularity="hybrid", description="one text: summary, keywords and session"),
    Method("memgas", edges="gmm", description="router + seeds + PPR over GMM association edges"),
    Method("memgas-no-gmm", edges="topk", description="top-k edges instead of the GMM"),
    Method("memgas-no-ppr", edges=None, ppr=False, description="router-weighted node scores, no graph"),
    Method("memgas-no-router", edges="gmm", router=False, description="equal granularity weights"),
    Method("memgas-no-association", edges=None, description="PPR on a graph without edges"),
)

METHODS: dict[str, Method] = {m.name: m for m in _ALL}
#: Names in the paper's table order (the default of ``retrieval.methods``).
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown retrieval method {name!r}; choose from {list(METHOD_NAMES)}") from None

#: JustMem methods (issue 17; scoring in :mod:`memgas.pipeline.justmem.retrieve`): ``justmem`` (the planner's
#: profile per question), the three fixed profiles, and ``cards`` (a session scores its best card).
#: TODO(issue 17 stage wiring): not yet rows of METHODS: ``retrieval.methods`` defaults to every METHODS name and
#: the rank stage scores them with ``retrieve.rank_history``, which cannot score these. Add them (with a
#: ``family`` the rank stage dispatches on) together with the cards/plan stages.
JUSTMEM_METHOD_NAMES: tuple[str, ...] = ("justmem", "justmem-lookup", "justmem-compose", "justmem-replay", "cards")

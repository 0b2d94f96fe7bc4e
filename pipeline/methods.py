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
    #: "memgas": scored by :func:`memgas.pipeline.retrieve.rank_history` from the node matrices; "justmem":
    #: scored by :func:`memgas.pipeline.justmem.retrieve.rank_history_cards` from the cards (the rank stage
    #: dispatches on it); "memgas-cards": by :func:`memgas.pipeline.card_graph.rank_card_graph` over five
    #: granularities, MemGAS's four and JustMem's cards
    family: str = "memgas"
    #: JustMem methods that read their chosen cards (``card_picks``) rather than the top-K sessions
    reads_cards: bool = False

    @property
    def is_graph(self) -> bool:
        """Methods scored from the four MemGAS node granularities (router, seeds, PPR)."""
        return self.family == "memgas" and self.granularity is None


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

#: JustMem methods (scoring in :mod:`memgas.pipeline.justmem.retrieve`): ``justmem`` (the planner's
#: profile per question), the three fixed profiles, and ``cards`` (a session scores its best card). Selecting
#: any of them enables JustMem's branch of stages (jobs/stages/justmem.py).
_JUSTMEM = (
    Method("justmem", family="justmem", reads_cards=True,
           description="planner's profile per question (Lookup/Compose/Replay)"),
    Method("justmem-lookup", family="justmem", reads_cards=True,
           description="top-K cards reranked against the question"),
    Method("justmem-compose", family="justmem", reads_cards=True,
           description="union of the question's and rewrites' candidates"),
    Method("justmem-replay", family="justmem", reads_cards=True,
           description="Lookup's cards; the reader recovers their turns"),
    Method("cards", family="justmem", description="a session scores its best card"),
)

#: Both systems in one graph: JustMem's cards as a fifth MemGAS granularity (router over five
#: granularities, cards associated by the GMM like any node, PPR over them). Its own stages
#: (jobs/stages/card_graph.py): selecting it adds them and leaves every other stage as it was.
_CARD_GRAPH = (
    Method("memgas-cards", edges="gmm", family="memgas-cards",
           description="router + seeds + PPR over five granularities: MemGAS's four and JustMem's cards"),
)

METHODS: dict[str, Method] = {m.name: m for m in (*_ALL, *_JUSTMEM, *_CARD_GRAPH)}
#: MemGAS names in the paper's table order: the default of ``retrieval.methods`` (JustMem methods are opt-in:
#: they add two stages, and a default that changed would re-run every existing config's rank stage).
METHOD_NAMES: tuple[str, ...] = tuple(m.name for m in _ALL)
JUSTMEM_METHOD_NAMES: tuple[str, ...] = tuple(m.name for m in _JUSTMEM)
CARD_GRAPH_METHOD_NAMES: tuple[str, ...] = tuple(m.name for m in _CARD_GRAPH)
#: Every name ``retrieval.methods`` and ``reading.methods`` accept.
KNOWN_METHOD_NAMES: tuple[str, ...] = (*METHOD_NAMES, *JUSTMEM_METHOD_NAMES, *CARD_GRAPH_METHOD_NAMES)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown retrieval method {name!r}; choose from {list(KNOWN_METHOD_NAMES)}") from None


def reads_cards(name: str) -> bool:
    """Whether method ``name`` answers from its chosen cards (JustMem reading) instead of ranked sessions."""
    return get_method(name).reads_cards


def uses_justmem(methods: list[str] | tuple[str, ...]) -> bool:
    """Whether any of ``methods`` is a JustMem method (then JustMem's branch of stages runs)."""
    return any(m in JUSTMEM_METHOD_NAMES for m in methods)


def uses_card_graph(methods: list[str] | tuple[str, ...]) -> bool:
    """Whether any of ``methods`` ranks over the five-granularity graph (then its stages and the cards run)."""
    return any(m in CARD_GRAPH_METHOD_NAMES for m in methods)

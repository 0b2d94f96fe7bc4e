"""JustMem (Wang, Zhi, Sha, arXiv 2609.19877) on the MemGAS bank: atomic memory cards with
provenance (:mod:`.extract`; their text: :mod:`.text`; the LLM reply's schema and checks: :mod:`.llm_cards`;
time expressions: :mod:`.times`), a query planner (:mod:`.plan`), retrieval over cards with Lookup / Compose /
Replay access (:mod:`.retrieve`) and the reading prompt (:mod:`.read`). JSON calls: :mod:`.structured`."""

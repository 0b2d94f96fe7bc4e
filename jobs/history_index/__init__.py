"""A history's persistent search structures: what the bank keeps of a history between runs so that an
append costs what it adds, and what a task is shipped of it.

================================  ==========================================================================
module                            what it holds
================================  ==========================================================================
``prefixes``                      :func:`chains`: per history, the digest of each session prefix (the identity
                                  every stored structure is checked against)
``block_reader``                  :class:`HistoryBlockReader`: a block of whole sessions gathered from the
                                  bank's nodes, pairs and embeddings (one pass over ``embeddings``)
``stored_blocks``                 :class:`StoredBlocks`: node blocks kept in table ``node_blocks`` (the
                                  complete ones, and the last one as far as the history goes, so that an
                                  append gathers only its own sessions), verified before use, written by
                                  whichever driver gathered them
``node_blocks``                   :class:`HistoryBlocks`, :func:`history_nodes`, :func:`keep_blocks`: a
                                  history's node vectors as :class:`NodeBlocks` for a task, each block
                                  shared through the executor (Ray) or spilled to a file (in-process)
``ivf_store``                     the saved IVF index and its deltas (tables ``ivf_index``, ``ivf_delta``):
                                  which are current, verification, chunked write and read, the delta policy,
                                  and :class:`IVFRun`, what one associate run knows of them
``ivf_mapped``                    a saved full index's copy as a faiss file that an append's driver maps
                                  instead of reading (checked by its digest, written again when damaged)
``ivf_units``                     an IVF unit: the index entry each segment is shipped, the rows an append
                                  found (searched once on the driver), the task's load / walk / save, the
                                  recall sample and its report
================================  ==========================================================================

Callers: the associate stage (edges, indexes), the rank stage and the latency probe (node blocks). Nothing
here imports Ray: a value a task needs is shared with :func:`memgas.jobs.executor.share` and read with
:func:`memgas.jobs.executor.fetch`.
"""

from memgas.jobs.history_index.block_reader import READ_BATCH_ROWS, HistoryBlockReader
from memgas.jobs.history_index.ivf_store import IVFRun, ivf_run
from memgas.jobs.history_index.node_blocks import HistoryBlocks, history_nodes, keep_blocks
from memgas.jobs.history_index.prefixes import chains
from memgas.jobs.history_index.stored_blocks import StoredBlocks

__all__ = ["READ_BATCH_ROWS", "HistoryBlockReader", "HistoryBlocks", "IVFRun", "StoredBlocks", "chains",
           "history_nodes", "ivf_run", "keep_blocks"]

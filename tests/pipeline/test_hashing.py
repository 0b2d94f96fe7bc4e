"""DigestSink (pipeline/hashing.py): a table serialised into it has the digest of the bytes that an in-memory
buffer would have held, so the digests of markers and rankings did not change when it replaced the buffers."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from memgas.jobs.stages.ranked import rows_digest
from memgas.jobs.stage import table_digest
from memgas.pipeline.hashing import DigestSink


def _table() -> pa.Table:
    n = 50_000  # several Parquet pages and IPC buffers
    rng = np.random.default_rng(0)
    return pa.table({"i": np.arange(n), "s": [f"text {i}" if i % 5 else None for i in range(n)],
                     "v": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(4 * n).astype(np.float32)), 4),
                     "l": [[str(i)] * (i % 3) for i in range(n)]})


def _buffered(write) -> str:  # the old way: the whole serialisation in memory, then hashed
    sink = pa.BufferOutputStream()
    write(sink)
    return hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=8).hexdigest()


def test_the_sink_digests_what_a_buffer_would_hold() -> None:
    t = _table()

    def ipc(sink) -> None:
        with pa.ipc.new_stream(sink, t.schema) as w:
            for b in t.combine_chunks().to_batches():
                w.write_batch(b)

    def parquet(sink) -> None:
        pq.write_table(t, sink, compression="none", write_statistics=False, use_dictionary=False)

    for write in (ipc, parquet):
        sink = DigestSink()
        write(pa.PythonFile(sink, mode="w"))
        assert sink.hexdigest() == _buffered(write)
    assert table_digest(t) == _buffered(ipc)
    assert rows_digest(t) == _buffered(parquet)
    assert table_digest(t.slice(1)) != table_digest(t)  # the rows decide it

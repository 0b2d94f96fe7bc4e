"""The driver gives back what a unit's reads freed: Arrow's allocator keeps the pages of freed buffers, and a
filtered read (a unit's rows out of a whole table, as the kernel stages read ``embeddings``) frees many."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from memgas.jobs import executor, tables
from memgas.jobs.stage import Active, Stage, StageContext
from memgas.pipeline import schema
from memgas.pipeline.bank import Bank
from memgas.pipeline.config import MemgasConfig

ROWS, DIM = 200_000, 96  # 77 MB of vectors, in row groups of 8,192 rows as embeddings' parts
COUNTS = pa.schema([("n", pa.int64())])


class ReadStage(Stage):
    """Each unit keeps 1 row in 50 of a table of vectors, read with a filter."""

    name = "read-some"
    writes = (tables.Table("read_some", "fingerprint"),)

    def inputs(self, ctx: StageContext, unit: dict[str, Any]) -> dict[str, Any]:
        want = [f"{i:032x}" for i in range(unit["first"], ROWS, 50)]
        got = pq.read_table(unit["path"], filters=pc.field("text_hash").isin(want))
        return {"n": got.num_rows}

    @staticmethod
    def run(model: None, payload: dict[str, Any], params: dict[str, Any]) -> dict[str, pa.Table]:
        return {"read_some": pa.table({"n": [payload["n"]]}, schema=COUNTS)}


def test_a_units_freed_read_buffers_go_back_to_the_os(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(schema.TABLES, "read_some", COUNTS)
    path = tmp_path / "vectors.parquet"
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({
        "text_hash": pa.array([f"{i:032x}" for i in range(ROWS)]),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(ROWS * DIM, dtype=np.float32)), DIM)}),
        path, row_group_size=8192)
    ctx = StageContext(MemgasConfig(), Bank.create(tmp_path / "bank"), None, use_ray=False)
    units = [{"part": f"read-some-{i}", "first": i, "path": str(path)} for i in range(2)]
    me = psutil.Process()
    pq.read_table(path, columns=["text_hash"])  # Arrow's threads start (their stacks are not what is measured)
    before = me.memory_full_info().uss
    counts = executor.execute_units(ReadStage(), ctx, Active(), units, ctx.bank, pools={})
    grown = (me.memory_full_info().uss - before) / 2**20
    assert counts["done"] == 2
    assert ctx.bank.read("read_some")["n"].to_pylist() == [4000, 4000]
    # kept by the allocator before, the freed decode buffers were ~200 MB here
    assert grown < 50, f"the driver kept {grown:.0f} MB after its units"

"""The associate stage's IVF search (``ivf_search.ivf_rows``) on seeded synthetic vectors."""

from __future__ import annotations

import dataclasses
from itertools import product
from pathlib import Path

import numpy as np
import pytest

from memgas.pipeline.association import ivf_search as I
from memgas.pipeline.association.exact_search import causal_rows
from memgas.pipeline.synth_vectors import clustered_nodes


@pytest.mark.parametrize("cut", [90, 96, 121])  # inside a grid block, on its edge, and in the next one
def test_rows_over_a_saved_index_equal_a_fresh_build_byte_for_byte(monkeypatch: pytest.MonkeyPatch, cut: int) -> None:
    """A history indexed to ``cut`` sessions, its index saved to bytes and loaded, then its later rows:
    the candidates (ids, scores) of one build over all 130 sessions, and the same saved index bytes; the
    exact prefix's rows are the exact search's."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    S, n0 = 130, 160
    E = clustered_nodes(0, S, dim=32, n_topics=20, seed=3)
    p = I.stage_params(8, 2, n0)
    fresh, ix_fresh = I.ivf_rows(E, 0, 4 * S, None, params=p)
    first, ix = I.ivf_rows(E[: 4 * cut], 0, 4 * cut, None, params=p)
    assert ix.ntotal == 4 * I.index_sessions(cut)
    loaded = I.index_from_bytes(I.index_bytes(ix).tobytes(), p, d=32, ntotal=ix.ntotal)
    rest, ix_rest = I.ivf_rows(E, 4 * cut, 4 * S, loaded, params=p)
    both = I._concat([first, rest], 30)
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(both, f), getattr(fresh, f)), f
    assert np.array_equal(I.index_bytes(ix_rest), I.index_bytes(ix_fresh))
    exact = causal_rows(E, 0, 4 * S)
    m = fresh.rows < n0
    assert np.array_equal(exact.cand[m], fresh.cand[m]) and np.array_equal(exact.scores[m], fresh.scores[m])
    assert not np.array_equal(exact.cand[~m], fresh.cand[~m]), "2 of 8 lists probed gave the exact candidates"


def test_an_index_read_from_its_chunks_is_the_index_read_from_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved index read from the chunks it is stored in (cut anywhere, even inside one of faiss's fields, and
    chunks smaller than one read) holds the same bytes and gives the same later rows as one buffer read."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    E = clustered_nodes(0, 130, dim=32, n_topics=20, seed=3)
    p = I.stage_params(8, 2, 160)
    _, ix = I.ivf_rows(E[: 4 * 96], 0, 4 * 96, None, params=p)
    data = I.index_bytes(ix).tobytes()
    cuts = [0, 1, 3, 4, 100, 101, len(data) // 2, len(data) - 7, len(data)]
    chunks = [np.frombuffer(data[a:b], np.uint8) for a, b in zip(cuts[:-1], cuts[1:])]
    one = I.index_from_bytes(data, p, d=32, ntotal=ix.ntotal)
    cut = I.index_from_bytes(chunks, p, d=32, ntotal=ix.ntotal)
    assert I.index_bytes(cut).tobytes() == data
    a, _ = I.ivf_rows(E, 4 * 96, 4 * 130, one, params=p)
    b, _ = I.ivf_rows(E, 4 * 96, 4 * 130, cut, params=p)
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def test_a_stored_index_that_is_not_what_its_row_says_is_refused() -> None:
    E = clustered_nodes(0, 60, dim=32, n_topics=20, seed=1)
    p = I.stage_params(4, 1, 160)
    _, ix = I.ivf_rows(E, 0, 240, None, params=p)
    data = I.index_bytes(ix).tobytes()
    with pytest.raises(ValueError, match="expected an IVF index of 64 of 32"):
        I.index_from_bytes(data, p, d=32, ntotal=64)


def test_near_ties_below_the_sq8_resolution_still_give_a_fresh_builds_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node within 1e-3 of one vector: the SQ8 store cannot order them, so which 45 the index
    fetches is arbitrary, while a block's own earlier nodes are fetched by exact scores. With the library's
    free block boundaries an append put A's last sessions in the index where a fresh build had them in the
    block, and the candidates of the appended rows differed; on the stage's grid they are the same."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    rng = np.random.default_rng(7)
    base = rng.normal(size=32)
    E = (base / np.linalg.norm(base) + 1e-3 * rng.normal(size=(4 * 40, 32))).astype(np.float32)
    E /= np.linalg.norm(E, axis=1, keepdims=True)
    p = I.stage_params(2, 1, 80)
    fresh, _ = I.ivf_rows(E, 0, 160, None, params=p)
    _, ix = I.ivf_rows(E[:120], 0, 120, None, params=p)
    rest, _ = I.ivf_rows(E, 120, 160, I.index_from_bytes(I.index_bytes(ix).tobytes(), p, d=32, ntotal=ix.ntotal),
                         params=p)
    m = fresh.rows >= 120
    assert np.array_equal(rest.cand, fresh.cand[m]) and np.array_equal(rest.scores, fresh.scores[m])


def test_a_mapped_index_with_its_deltas_apart_gives_the_loaded_indexs_rows_and_delta(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved index mapped from its file (``raw_from_file``), a delta merged and the walk's blocks added apart
    (``CausalIVF.stacked``): the later rows' candidates (ids, scores) and the delta they save equal those of the
    index read into memory with the same delta merged, byte for byte. Every session from 20 on repeats an
    earlier one, so equal scores sit in the mapped part and in the part apart, and a fetch of 5 cuts their
    groups: it keeps the same of them only if both parts are scanned in the merged index's order (searching
    the part apart first fails this test)."""
    from memgas.pipeline.association.faiss_index import raw_from_file

    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    E = clustered_nodes(0, 130, dim=32, n_topics=4, seed=3)
    E[4 * 20 :] = E[np.arange(4 * 20, 4 * 130) % (4 * 20)]  # sessions repeated: nodes of equal scores
    p = dataclasses.replace(I.stage_params(2, 1, 80), fetch=5)  # a fetch of 5 cuts the groups of equal scores
    _, ix = I.ivf_rows(E[: 4 * 64], 0, 4 * 64, None, params=p)
    (tmp_path / "full.faiss").write_bytes(I.index_bytes(ix).tobytes())
    ix.start_delta()
    _, ix = I.ivf_rows(E[: 4 * 96], 4 * 64, 4 * 96, ix, params=p)
    delta = I.delta_bytes(ix).tobytes()

    def with_delta(index: I.CausalIVF) -> I.CausalIVF:
        index.merge_delta(I.raw_from_bytes(delta, d=32, ntotal=4 * 32))
        index.start_delta()
        return index

    loaded = with_delta(I.index_from_bytes((tmp_path / "full.faiss").read_bytes(), p, d=32, ntotal=4 * 64))
    mapped = with_delta(I.CausalIVF.stacked(raw_from_file(tmp_path / "full.faiss", d=32, ntotal=4 * 64), p))
    assert mapped.ntotal == loaded.ntotal == 4 * 96
    a, _ = I.ivf_rows(E, 4 * 96, 4 * 130, loaded, params=p)
    b, _ = I.ivf_rows(E, 4 * 96, 4 * 130, mapped, params=p)
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert mapped.ntotal == loaded.ntotal == 4 * 128
    assert I.delta_bytes(mapped).tobytes() == I.delta_bytes(loaded).tobytes()
    with pytest.raises(ValueError, match="never whole"):
        I.index_bytes(mapped)


# -- the recall sample: the bottom-k row keys of a history, whatever its cut --------------------------------------
def test_row_keys_are_fixed_distinct_and_per_row() -> None:
    """A row's key depends on (seed, history, node id) only: pinned values (the same on every machine), the
    same whichever other rows are asked for, distinct within a history, other values in another history."""
    rows = np.arange(100_000, dtype=np.int64)
    keys = I.row_keys("h0", rows)
    assert keys.dtype == np.uint64
    assert keys[:3].tolist() == PINNED_KEYS
    assert np.unique(keys).size == rows.size
    assert all(I.row_keys("h0", rows[[i]])[0] == keys[i] for i in (0, 7, 99_999))
    assert not np.array_equal(I.row_keys("h1", rows[:1000]), keys[:1000])


#: row_keys("h0", [0, 1, 2]) under RECALL_SEED 29 (checked against a pure-Python splitmix64 of the same base)
PINNED_KEYS = [7007313346863902838, 10262934957297190534, 7466430387267049020]


@pytest.mark.parametrize("k", [1, 5, 64, 1000])
def test_the_union_of_the_units_bottom_k_holds_the_historys_bottom_k(k: int) -> None:
    """Two histories' rows past an exact prefix, cut into units in several ways (one unit, fixed widths, uneven
    cuts): each unit keeps its bottom-k (``recall_sample``), and the bottom-k of the union per history
    (``history_sample``) is the history's bottom-k computed by sorting every row's key (an oracle)."""
    rows = {"h0": np.arange(400, 1500, dtype=np.int64), "h1": np.arange(80, 300, dtype=np.int64)}
    oracle = {h: sorted(r.tolist(), key=lambda x, h=h: int(I.row_keys(h, np.array([x]))[0]))[:k]
              for h, r in rows.items()}
    for cuts, first in product(([], [500], [410, 411, 900, 1499], list(range(400, 1500, 96)),
                                list(range(100, 300, 7))), (False, True)):
        hist, got_rows, got_keys = [], [], []
        for h, r in rows.items():
            for unit in np.split(r, np.searchsorted(r, cuts)):
                # first: a unit also leaves out the rows that k earlier units' rows beat (recall_sample)
                s, keys = I.recall_sample(h, unit, k, first_row=int(r[0]) if first else None)
                alone, _ = I.recall_sample(h, unit, k)
                assert alone.size == min(k, unit.size) and np.array_equal(s, np.sort(s))
                assert np.isin(s, alone).all() and np.array_equal(keys, I.row_keys(h, s))
                if first and unit.size and unit[0] - r[0] >= k:
                    earlier = np.sort(I.row_keys(h, np.arange(r[0], unit[0])))[k - 1]
                    assert np.array_equal(s, alone[I.row_keys(h, alone) < earlier])  # oracle: a full sort
                hist += [h] * s.size
                got_rows.append(s)
                got_keys.append(keys)
        r, keys = np.concatenate(got_rows), np.concatenate(got_keys)
        keep = I.history_sample(np.array(hist, dtype=object), keys, k)
        got = {h: sorted(r[keep][np.array(hist, dtype=object)[keep] == h].tolist()) for h in rows}
        assert got == {h: sorted(o) for h, o in oracle.items()}, cuts


def test_a_rows_hits_do_not_depend_on_the_other_sampled_rows() -> None:
    """``candidate_hits`` of a sample equals that of its rows asked for in two other calls (the exact search
    has canonical shapes): a row's counts are the same in whichever unit samples it."""
    E = clustered_nodes(0, 60, dim=32, n_topics=20, seed=2)
    c, _ = I.ivf_rows(E, 0, 240, None, params=I.stage_params(4, 1, 80))
    sample = np.arange(80, 240, 3, dtype=np.int64)
    hits, total = I.candidate_hits(E, c, sample, 30)
    parts = [I.candidate_hits(E, c, s, 30) for s in (sample[::2], sample[1::2])]
    assert np.array_equal(np.sort(np.concatenate([sample[::2], sample[1::2]])), sample)
    assert hits[::2].tolist() == parts[0][0].tolist() and hits[1::2].tolist() == parts[1][0].tolist()
    assert total[::2].tolist() == parts[0][1].tolist() and total[1::2].tolist() == parts[1][1].tolist()
    assert I.candidate_recall(E, c, sample, 30) == (int(hits.sum()), int(total.sum()))
    assert 0 < hits.sum() < total.sum(), "1 of 4 lists probed found every exact candidate, or none"


def test_the_in_block_pairs_scored_in_chunks_give_the_same_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-block search scores its (row, node) pairs ``PAIR_CHUNK`` at a time: any chunk gives the same
    candidates and scores, bit for bit (each pair's dot product is its own)."""
    monkeypatch.setattr(I, "STAGE_BLOCK_SESSIONS", 16)
    E = clustered_nodes(0, 130, dim=32, n_topics=20, seed=3)
    p = I.stage_params(2, 1, 80)  # two lists: many pairs a row
    whole, _ = I.ivf_rows(E, 0, 4 * 130, None, params=p)
    monkeypatch.setattr(I, "PAIR_CHUNK", 7)
    cut, _ = I.ivf_rows(E, 0, 4 * 130, None, params=p)
    for f in ("rows", "cand", "valid", "scores"):
        assert np.array_equal(getattr(whole, f), getattr(cut, f)), f

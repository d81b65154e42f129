"""``sparse-rows`` (FORMAT.md §5f): the active rows of a table, then ``sparse-exp2`` over their elements.

Checked here: segments that start and end inside rows decode to exactly what was written, with the
compiled loops and with numpy (the same bytes); a reader written from §5f's text alone (its row
pieces and the gathered range) finds the same changes; every flipped bit is caught or changes the
weights; the writer takes it where rows say where the changes are (an embedding table) and not where
they do not (a dense matrix, a vector); readers refuse it on a tensor without rows before fetching.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec.encoding import check_block
from xcluster.codec.encodings import sparse_exp2 as exp2
from xcluster.codec.encodings import sparse_rows as sr
from xcluster.codec.kernels import expread, exprank, expwrite
from xcluster.codec.kernels.changes import UINT, find_changes, unzigzag, zigzag_diff
from xcluster.errors import DecodeError, FormatError
from tests.unit.helpers import assert_state_equal, memory_store

WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@contextlib.contextmanager
def numpy_only():
    """The no-numba paths of the writer and the reader."""
    with mock.patch.object(exprank, "_kernels", lambda: None), mock.patch.object(expwrite, "_kernels", lambda: None), \
            mock.patch.object(expread, "_kernels", lambda: None):
        yield


def table_step(rows: int, row: int, active: np.ndarray, per_row: int, width: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Raw bits of a table and of its next step, which moves ``per_row`` elements (at most) of each
    row of ``active`` by a few raw steps."""
    rng = np.random.default_rng(seed)
    udt = UINT[width]
    old = rng.integers(0, 1 << (8 * width), rows * row, dtype=np.uint64).astype(udt)
    new = old.copy()
    for r in active.tolist():
        cols = rng.choice(row, min(per_row, row), replace=False)
        top = 1 << (8 * width)
        new[r * row + cols] += rng.choice(np.array([1, 2, top - 1, top - 3], dtype=udt), cols.size)
    return old, new


def decode(pieces: list[np.ndarray], rng_old: np.ndarray, start: int, row: int, nnz: int, dtype: str):
    inner, rows_in = sr.readers(pieces, WIDTH[dtype], "t")
    pos, z = sr.read_segment(inner, rows_in, rng_old, start, row, nnz, dtype, UINT[WIDTH[dtype]])
    inner.finish()
    rows_in.finish()
    return pos, z


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(sorted(WIDTH)), row=st.integers(1, 70), rows=st.integers(1, 60),
       share=st.floats(0.0, 1.0), per_row=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       cut=st.tuples(st.floats(0.0, 1.0), st.floats(0.0, 1.0)))
def test_segments_inside_rows_roundtrip_compiled_and_numpy(dtype, row, rows, share, per_row, seed, cut):
    w = WIDTH[dtype]
    n = rows * row
    rng = np.random.default_rng(seed)
    active = np.flatnonzero(rng.random(rows) < share)
    old, new = table_step(rows, row, active, per_row, w, seed)
    a, b = sorted((int(cut[0] * n), int(cut[1] * n)))  # any range: it may start and end inside rows
    b = max(b, a + 1)
    pos, ov, nv = find_changes(old[a:b], new[a:b])
    if pos.size == 0:
        return
    z = zigzag_diff(ov, nv)
    pieces = sr.build(old[a:b], pos, z, dtype, a, row)
    with numpy_only():
        assert all(np.array_equal(p, q) for p, q in zip(pieces, sr.build(old[a:b], pos, z, dtype, a, row)))
        got_np = decode(pieces, old[a:b], a, row, pos.size, dtype)
    got = decode(pieces, old[a:b], a, row, pos.size, dtype)
    for p, zz in (got, got_np):
        assert np.array_equal(p, pos.astype(np.int64)) and np.array_equal(zz, z)
    out = old[a:b].copy()
    out[got[0]] += unzigzag(got[1])
    assert np.array_equal(out, new[a:b])


def _spec_rows(head: np.ndarray, quot: np.ndarray, rem: np.ndarray) -> list[int]:
    """§5f's active rows read from its text: m and k from the head, then one Rice group of m gaps."""
    m, k = int.from_bytes(head[:4].tobytes(), "little"), int(head[4])
    qbits = [(int(x) >> i) & 1 for x in quot.tolist() for i in range(8)]
    rbits = [(int(x) >> i) & 1 for x in rem.tolist() for i in range(8)]
    rows, qi, ri, prev = [], 0, 0, -1
    for _ in range(m):
        q = 0
        while qbits[qi] == 0:
            q, qi = q + 1, qi + 1
        qi += 1
        low = sum(rbits[ri + i] << i for i in range(k))
        ri += k
        prev = prev + 1 + ((q << k) | low)
        rows.append(prev)
    assert not any(qbits[qi:]) and not any(rbits[ri:]) and len(quot) == (qi + 7) // 8 and len(rem) == (ri + 7) // 8
    return rows


def test_a_reader_from_the_format_text_finds_the_same_changes():
    """Rows and the gathered range as §5f words them, element by element in plain Python; the
    gathered part is then a sparse-exp2 segment (its own spec tests: test_rans.py, test_golden.py)."""
    row, rows = 37, 90
    old, new = table_step(rows, row, np.array([0, 1, 5, 40, 41, 89]), 6, 2, seed=5)
    for start, end in ((0, rows * row), (20, 3000), (37 * 5, 37 * 42), (150, 200), (190, 200)):
        pos, ov, nv = find_changes(old[start:end], new[start:end])
        assert pos.size
        z = zigzag_diff(ov, nv)
        pieces = sr.build(old[start:end], pos, z, "bfloat16", start, row)
        count, o = end - start, start % row
        n_rows = (start + count - 1) // row - start // row + 1
        active = _spec_rows(*pieces[5:8])
        assert active == sorted({(start + p) // row - start // row for p in pos.tolist()})
        assert max(active) < n_rows
        gathered = [j for j in range(count) if (j + o) // row in set(active)]  # lo_j … hi_j − 1, row after row
        reader = exp2.SegmentReader(pieces[:5], 2, "spec")
        gpos, gz = reader.segment(old[start:end][np.array(gathered, dtype=np.int64)], pos.size, "bfloat16",
                                  np.uint16)
        reader.finish()
        assert [gathered[c] for c in gpos.tolist()] == pos.tolist() and np.array_equal(gz, z)


def test_every_flipped_bit_is_caught_or_changes_the_weights():
    row = 48
    old, new = table_step(300, row, np.array([3, 4, 77, 150, 151, 152, 299]), 8, 2, seed=9)
    a, b = 100, 300 * row - 7
    pos, ov, nv = find_changes(old[a:b], new[a:b])
    z = zigzag_diff(ov, nv)
    pieces = sr.build(old[a:b], pos, z, "bfloat16", a, row)
    caught = wrong = 0
    for s in range(len(pieces)):
        for byte in range(pieces[s].size):
            for bit in (0, 3, 7):
                bad = [p.copy() for p in pieces]
                bad[s][byte] ^= 1 << bit
                try:
                    p2, z2 = decode(bad, old[a:b], a, row, pos.size, "bfloat16")
                except DecodeError:
                    caught += 1
                    continue
                out = old[a:b].copy()
                out[p2] += unzigzag(z2)
                assert not np.array_equal(out, new[a:b])  # a digest catches it: never the right weights by luck
                wrong += 1
    assert caught > wrong > 0  # counts and row pieces are checked; sign flips pass to the digest


def test_row_pieces_that_break_the_rules_are_named():
    row = 10
    old, new = table_step(50, row, np.array([2, 30]), 4, 2, seed=1)
    pos, ov, nv = find_changes(old, new)
    z = zigzag_diff(ov, nv)
    pieces = sr.build(old, pos, z, "bfloat16", 0, row)

    def with_head(m: int, k: int | None = None) -> list[np.ndarray]:
        bad = [p.copy() for p in pieces]
        bad[5][:4] = np.frombuffer(m.to_bytes(4, "little"), dtype=np.uint8)
        if k is not None:
            bad[5][4] = k
        return bad

    for bad, match in ((with_head(0), "0 active rows"), (with_head(pos.size + 1), "active rows for a segment"),
                       (with_head(2, 32), "Rice parameter is over 31"), (pieces[:5] + [pieces[5][:4]] + pieces[6:],
                                                                         "row head stream ends early")):
        with pytest.raises(DecodeError, match=match):
            decode(bad, old, 0, row, pos.size, "bfloat16")
    with pytest.raises(DecodeError, match="past the segment's last row"):  # the same bytes on a shorter range
        decode(pieces, old[:25 * row], 0, row, pos.size, "bfloat16")
    # a row named active that holds none of the changes: rows 2, 3 coded, the changes are in 2 and 30
    rows_bad = sr._row_pieces(np.array([2, 3]), 50)
    inner_ok = sr.build(old, pos, z, "bfloat16", 0, row)[:5]
    with pytest.raises(DecodeError):
        decode(inner_ok + rows_bad, old, 0, row, pos.size, "bfloat16")


def embedding_versions(steps: int, seed: int = 4) -> list[dict[str, torch.Tensor]]:
    """A word-embedding-like table (a step moves a few elements of the few rows a batch holds) and a
    dense matrix (1% of its elements at random)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cur = {"emb": (torch.randn(3000, 64, generator=g) * 0.05).to(torch.bfloat16),
           "w": (torch.randn(128, 128, generator=g) * 0.05).to(torch.bfloat16),
           "b": (torch.randn(3000, generator=g) * 0.05).to(torch.bfloat16)}
    out = [cur]
    for _ in range(steps):
        cur = {k: v.clone() for k, v in cur.items()}
        e = cur["emb"].view(torch.int16)
        for r in rng.choice(3000, 40, replace=False).tolist():
            cols = torch.from_numpy(rng.choice(64, 5, replace=False))
            e[r, cols] += torch.from_numpy(rng.choice(np.array([-1, 1], dtype=np.int16), 5))
        for k in ("w", "b"):
            bits = cur[k].view(torch.int16).reshape(-1)
            idx = torch.from_numpy(rng.choice(bits.numel(), bits.numel() // 100, replace=False))
            bits[idx] += 1
        out.append(cur)
    return out


def test_the_writer_takes_it_for_a_table_and_followers_and_joiners_agree():
    versions = embedding_versions(4)
    sizes = {}
    for label, enc in (("default", CodecConfig().encodings),
                       ("without", tuple(e for e in CodecConfig().encodings if e != sr.NAME))):
        store = memory_store()
        pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3, codec=CodecConfig(encodings=enc)))
        follower = Subscriber(store=store)
        written = 0
        for i, sd in enumerate(versions):
            res = pub.publish(sd, step=i)
            written += res.bytes_written if res.kind == "delta" else 0
            assert follower.sync() == res.version
            assert_state_equal(follower.state_dict(), sd)
            m = follower.manifest
            on = {m.tensors[s.tensor].name for b in m.blocks if b.encoding == sr.NAME for s in b.segments}
            if res.kind == "delta" and label == "default":
                assert on == {"emb"}  # not the dense matrix, not the vector
            elif label == "without":
                assert not on
        joiner = Subscriber(store=store)  # from the keyframe at version 4, then the delta after it
        assert joiner.sync() == follower.version and joiner.model_digest == follower.model_digest
        sizes[label] = written
    assert sizes["default"] < sizes["without"], sizes


def test_the_writer_leaves_it_where_rows_say_nothing():
    """A dense matrix changes in nearly every row: past MAX_ACTIVE the trial is skipped."""
    old, new = table_step(64, 256, np.arange(64), 4, 2, seed=2)
    pos, ov, nv = find_changes(old, new)
    from xcluster.codec.encoding import RangeInput

    r = RangeInput("bfloat16", 2, old.size, int(pos.size), old=old, pos=pos, z=zigzag_diff(ov, nv), start=0, row=256)
    with mock.patch.object(sr, "_build", side_effect=AssertionError("tried")):
        assert sr.ENCODING.offer(r, None, lambda: 10**9, CodecConfig()) is None
        assert sr.ENCODING.offer(replace(r, row=0), None, lambda: 10**9, CodecConfig()) is None  # no rows
    few = RangeInput("bfloat16", 2, old.size, int(pos.size), old=old, pos=pos, z=r.z, start=0, row=256 * 64)
    assert sr.ENCODING.offer(few, None, lambda: 1, CodecConfig()) is None  # tried, and not smaller


def test_a_segment_on_a_tensor_without_rows_is_refused_before_fetching():
    store = memory_store()
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    versions = embedding_versions(1)
    for i, sd in enumerate(versions):
        pub.publish(sd, step=i)
    sub = Subscriber(store=store)
    sub.sync()
    m = sub.manifest
    bi = next(i for i, b in enumerate(m.blocks) if b.encoding == sr.NAME)
    tensors = list(m.tensors)
    t = m.blocks[bi].segments[0].tensor
    check_block(m.blocks[bi], tensors, where="ok")
    tensors[t] = replace(tensors[t], shape=(tensors[t].shape[0] * tensors[t].shape[1],))
    with pytest.raises(FormatError, match="2 or more dimensions"):
        check_block(m.blocks[bi], tensors, where="flat")

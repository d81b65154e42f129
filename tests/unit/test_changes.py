import numpy as np
import pytest

from xcluster.codec.kernels import changes
from xcluster.codec.kernels.changes import (SCAN_ELEMENTS, find_changes, gaps_of, join_planes, sparse_sub_pieces, split_planes,
                                     unzigzag, zigzag_diff)
from xcluster.codec.dtypes import UINT


@pytest.mark.parametrize("numpy", [False, True], ids=["compiled", "numpy"])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 4099, SCAN_ELEMENTS + 13])
@pytest.mark.parametrize("layout", ["aligned", "unaligned", "dense", "clustered"])
def test_find_changes_matches_naive(width, n, layout, numpy):
    """Whatever the width, the alignment of the word views and the density, by the compiled
    loop (its outputs grown several times over when dense, or when the changes crowd into a
    few runs of words) and by numpy."""
    rng = np.random.default_rng(width * 1000 + n)
    dt = UINT[width]
    old = rng.integers(0, np.iinfo(dt).max, size=n, dtype=dt, endpoint=True)
    if layout == "unaligned":  # one element into a buffer: the word views are not 8-byte aligned
        buf = np.empty(n + 1, dtype=dt)
        buf[1:] = old
        old = buf[1:]
    new = old.copy()
    k = (n if layout == "dense" else max(1, n // 50)) if n else 0
    idx = rng.choice(n, size=k, replace=False) if n else np.empty(0, dtype=np.int64)
    if layout == "clustered":  # every element of a few runs: whole groups of eight words differ
        idx = np.concatenate([np.arange(s, min(n, s + 97)) for s in range(0, n, 1000)]) if n else idx
    new[idx] ^= dt(1)
    if n:
        new[-1] = old[-1] + dt(3)  # the unaligned tail
    if not numpy and not changes._kernels():
        pytest.skip("numba is not available")
    pos, ov, nv = find_changes(old, new, numpy=numpy)
    want = np.flatnonzero(old != new)
    assert pos.dtype == np.int64 and ov.dtype == nv.dtype == dt
    np.testing.assert_array_equal(pos, want)
    np.testing.assert_array_equal(ov, old[want])
    np.testing.assert_array_equal(nv, new[want])


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_zigzag_roundtrip_and_small_steps(width):
    dt = UINT[width]
    top = np.iinfo(dt).max
    old = np.array([0, 1, top, top - 1, 5, 0], dtype=dt)
    new = np.array([1, 0, 0, top, 5, top], dtype=dt)
    z = zigzag_diff(old, new)
    np.testing.assert_array_equal(old + unzigzag(z), new)
    assert list(z[:2]) == [2, 1] and z[4] == 0  # +1 -> 2, -1 -> 1, no change -> 0


def test_planes_roundtrip():
    v = (np.arange(1000, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    planes = split_planes(v)
    assert len(planes) == 4 and all(p.dtype == np.uint8 for p in planes)
    np.testing.assert_array_equal(planes[0], (v & 0xFF).astype(np.uint8))
    np.testing.assert_array_equal(join_planes(planes, np.uint32), v)


def test_compressors_kept_per_thread_write_what_a_new_one_writes():
    """streams.compress keeps one zstd compressor per thread and level: frames made on two threads
    at once, at two levels, in turn with failed ones, are each what a fresh compressor makes."""
    import threading

    import zstandard

    from xcluster.codec import streams

    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 1 << int(rng.integers(1, 8)), int(rng.integers(1, 20000)), dtype=np.uint8)
              for _ in range(40)]
    want = {(i, lvl): zstandard.ZstdCompressor(level=lvl, write_content_size=True).compress(x.tobytes())
            for i, x in enumerate(inputs) for lvl in (1, 3)}
    got: dict[tuple[int, int], bytes] = {}
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for j in range(len(inputs)):
                i = (j + offset) % len(inputs)
                for lvl in (1, 3):
                    with pytest.raises(ValueError):  # a frame abandoned midway (a strided piece)
                        streams.compress([inputs[i], np.zeros(64, dtype=np.uint8)[::2]], level=lvl)
                    codec, payload = streams.compress([inputs[i][:7], inputs[i][7:]], level=lvl)
                    got[i, lvl] = payload if codec == streams.ZSTD else None
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k * 13,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for key, frame in want.items():
        assert got[key] == (frame if len(frame) < inputs[key[0]].nbytes else None)


@pytest.mark.parametrize("level", [1, 3, 19])
def test_content_of_up_to_min_frame_bytes_never_compresses(level):
    """streams.compress stores content of at most MIN_FRAME bytes raw without trying zstd: no
    zstd frame of such content is smaller (RFC 8878), checked here over every length and kinds of
    content, so skipping the attempt writes the bytes trying would."""
    import zstandard

    from xcluster.codec import streams

    rng = np.random.default_rng(level)
    z = zstandard.ZstdCompressor(level=level, write_content_size=True)
    for n in range(1, 3 * streams.MIN_FRAME):
        for x in (bytes(n), b"\x07" * n, rng.integers(0, 2, n, dtype=np.uint8).tobytes(),
                  rng.integers(0, 256, n, dtype=np.uint8).tobytes()):
            frame = z.compress(x)
            assert len(frame) >= streams.MIN_FRAME or n > streams.MIN_FRAME
            want = (streams.ZSTD, frame) if len(frame) < n else (streams.RAW, x)
            piece = np.frombuffer(x, dtype=np.uint8)
            assert streams.compress([piece], level=level) == want
            assert streams.stored_size([piece[:3], piece[3:]], level=level) == len(want[1])


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 5000])
def test_sparse_sub_pieces_are_the_planes_of_gaps_and_zigzags(width, n):
    """One compiled pass (widths 1, 2, 4) gives the byte planes of gaps_of and zigzag_diff, gaps up
    to 2**32 - 1 and differences that wrap included; the numpy path gives the same."""
    if width < 8 and n and changes._kernels() is None:
        pytest.skip("numba is not importable here")
    rng = np.random.default_rng(width + n)
    dt = UINT[width]
    ov = rng.integers(0, np.iinfo(dt).max, size=n, dtype=dt, endpoint=True)
    nv = rng.integers(0, np.iinfo(dt).max, size=n, dtype=dt, endpoint=True)
    nv[: n // 2] = ov[: n // 2] + np.array([1, -1], dtype=np.int64).astype(dt)[np.arange(n // 2) % 2]  # ±1 ulp
    pos = np.sort(rng.choice(1 << 33, size=n, replace=False)) if n else np.empty(0, dtype=np.int64)
    if n:
        pos -= pos[0]
        pos = pos[pos < 1 << 32][: n]  # gaps of up to 2**32 - 1 inside one range
        ov, nv = ov[: pos.size], nv[: pos.size]
    want_z = zigzag_diff(ov, nv)
    want = split_planes(gaps_of(pos)) + split_planes(want_z)
    for numpy in (False, True):
        got, z = sparse_sub_pieces(pos, ov, nv, numpy=numpy)
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want] and len(got) == 4 + width
        assert z.dtype == dt and z.tobytes() == want_z.tobytes()


def test_compiled_loops_load_where_numba_is_installed(monkeypatch):
    """numba is a dependency: its loops here must compile and pass their smoke run (a loop that
    gives wrong changes is refused there, and every caller would fall back to numpy unseen)."""
    pytest.importorskip("numba")
    monkeypatch.delenv("XCLUSTER_NO_NUMBA", raising=False)
    changes._kernels.cache_clear()
    try:
        assert changes._kernels() is not None
    finally:
        changes._kernels.cache_clear()

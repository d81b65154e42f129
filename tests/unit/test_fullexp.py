"""``full-exp`` (FORMAT.md §5c): whole bf16 values as exponent-window symbol bytes, escapes and raw
bits; and the piecewise stream reader it decodes its symbols with."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec import streams
from xcluster.codec.encoding import parse_manifest
from xcluster.codec.encodings import full_exp as fullexp
from xcluster.codec.encode import encode_version
from xcluster.errors import DecodeError, DecompressionBombError
from xcluster.codec.encoding import core_names
from tests.unit.helpers import bf16_weights as weights
from tests.unit.helpers import manifest_bytes, memory_store
from tests.unit.test_full_values import published, state
FULL_EXP, PLANES = "full-exp", "planes"
CORE_ENCODINGS = core_names()

LOOPS = [False, True] if fullexp.compiled() else [True]
"""numpy=False (the compiled loops) and numpy=True."""


def roundtrip(u: np.ndarray) -> list[np.ndarray]:
    """Both implementations write the same pieces, and both read them back bit for bit."""
    pieces = [fullexp.encode(u, numpy=numpy) for numpy in LOOPS]
    for p in pieces[1:]:
        assert all(np.array_equal(x, y) for x, y in zip(pieces[0], p))
    for numpy in LOOPS:
        r = fullexp.SegmentReader(pieces[0], where="t", numpy=numpy)
        got = r.segment(u.size, "t")
        r.finish()
        assert got.dtype == np.uint16 and np.array_equal(got, u)
    return pieces[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 63, 4096, 4099, 100_003, fullexp.PIECE + 5])
def test_roundtrip_every_length(n):
    base, sym, esc, raw = roundtrip(weights(n, seed=n))
    assert base.size == 1 and sym.size == n and raw.size == fullexp.raw_bytes(n)


def _spec_raw(u: np.ndarray) -> bytes:
    """The raw piece of FORMAT.md §5e written from its text, one field and one byte at a time."""
    r = [(int(x) & 31) | ((int(x) >> 15) << 5) for x in u]
    n = len(r)
    out = bytearray()
    for k in range(n // 64):
        f = r[64 * k:64 * k + 64]
        out += bytes((f[i] & 15) | ((f[32 + i] & 15) << 4) for i in range(32))
        out += bytes((f[i] >> 4) | ((f[16 + i] >> 4) << 2) | ((f[32 + i] >> 4) << 4) | ((f[48 + i] >> 4) << 6)
                     for i in range(16))
    tail = r[64 * (n // 64):]
    bits = sum(v << (6 * j) for j, v in enumerate(tail))
    out += bits.to_bytes((6 * len(tail) + 7) // 8, "little")
    return bytes(out)


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 128, 200])
def test_raw_fields_are_laid_out_as_the_format_says(n):
    u = np.random.default_rng(n).integers(0, 1 << 16, n, dtype=np.uint16)
    want = _spec_raw(u)
    assert len(want) == fullexp.raw_bytes(n)
    for numpy in LOOPS:
        assert fullexp.encode(u, numpy=numpy)[3].tobytes() == want


def test_a_large_segment_chooses_its_base_from_a_sample_and_escapes_what_it_missed():
    n = 4 * fullexp.HIST_SAMPLED
    u = weights(n, seed=9)
    odd = np.arange(7, n, 1001)
    odd = odd[odd % fullexp.HIST_STEP != 0]  # none of them in the sample
    u[odd] = 0x0100 | (u[odd] & 0x807F)  # exponent 2, far below any window that holds the weights
    base, sym, esc, raw = roundtrip(u)
    assert base[0] > 2 and esc.size == odd.size and (esc == 2).all()
    assert (sym[odd] >= fullexp.ESCAPE).all()


@pytest.mark.parametrize("kind", ["constant", "zeros", "every-value", "random-bits", "specials", "wide"])
def test_roundtrip_odd_distributions(kind):
    gen = np.random.default_rng(3)
    if kind == "constant":
        u = np.full(10_001, 0x3F80, dtype=np.uint16)
    elif kind == "zeros":  # exponent 0 only: base 0
        u = np.zeros(5003, dtype=np.uint16)
    elif kind == "every-value":  # every exponent: 256 - 63 of them escaped
        u = np.arange(1 << 16, dtype=np.uint16)
    elif kind == "random-bits":
        u = gen.integers(0, 1 << 16, 77_777, dtype=np.uint16)
    elif kind == "specials":  # NaN payloads, infinities, signed zeros, subnormals
        u = np.array([0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F] * 37, dtype=np.uint16)
    else:  # weights and a few huge and tiny values outside any window that holds the weights
        u = weights(20_000, seed=4)
        u[::1000] = 0x7000
        u[1::1000] = 0x0100
    base, sym, esc, raw = roundtrip(u)
    e = (u >> 7) & 255
    outside = (e < int(base[0])) | (e >= int(base[0]) + fullexp.WINDOW)
    assert np.array_equal(esc, e[outside]) and ((sym >= fullexp.ESCAPE) == outside).all()
    if kind == "every-value":
        assert esc.size == (256 - fullexp.WINDOW) * 256
    if kind in ("constant", "specials"):
        assert int(base[0]) == fullexp.PREFERRED_BASE or kind == "specials"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(st.integers(0, (1 << 16) - 1), min_size=1, max_size=300), skew=st.integers(0, 3))
def test_property_any_values(data, skew):
    u = np.array(data, dtype=np.uint16)
    if skew:  # fewer distinct exponents, as in real weights
        u = (u & np.uint16(0x80FF)) | np.uint16(0x3C00 + 0x100 * skew)
    roundtrip(u)


def test_choose_base():
    h = np.zeros(256, dtype=np.int64)
    h[100:126] = 5
    assert fullexp.choose_base(h) == 80  # every base from 63 to 100 holds them all: the preferred one
    h[60] = 1
    assert fullexp.choose_base(h) == 80  # 60 … 125 do not fit one window: 60 is escaped
    h[150] = 1
    assert fullexp.choose_base(h) == 88  # bases 88 … 100 hold 100 … 150: the one nearest 80
    h[:] = 0
    h[200:] = 1
    assert fullexp.choose_base(h) == fullexp.MAX_BASE
    h[:] = 0
    h[5] = 3
    assert fullexp.choose_base(h) == 5  # bases 0 … 5 hold it: the one nearest 80
    h[:] = 0
    h[150:170] = 1
    h[10:20] = 1  # two clusters of ten and twenty: the larger one, base as near 80 as it allows
    assert fullexp.choose_base(h) == 107


def test_it_pays_on_weights():
    """About 10.6 bits per element on Gaussian-like weights, against 16 raw (byte planes + zstd
    spend about 11.0 on such data)."""
    u = weights(200_000)
    base, sym, esc, raw = fullexp.encode(u)
    coded = len(zstandard.ZstdCompressor(level=fullexp.SYMBOLS_ZSTD_LEVEL).compress(sym.tobytes()))
    bits = 8 * (coded + esc.size + raw.size) / u.size
    assert 9.5 < bits < 10.9


# --- every check a reader makes ---------------------------------------------------------------
N = 4099


def _pieces(n=N):
    u = weights(n, seed=7)
    u[5] = 0x7000  # one escape
    return [p.copy() for p in fullexp.encode(u)]


def _read(pieces, n=N, numpy=False):
    r = fullexp.SegmentReader(pieces, where="t", numpy=numpy)
    out = r.segment(n, "w")
    r.finish()
    return out


@pytest.mark.parametrize("numpy", LOOPS)
@pytest.mark.parametrize("case, match", [
    ("base-high", "above 193"),
    ("bases-short", "bases stream ends early"),
    ("symbols-short", "symbols stream ends early"),
    ("raw-short", "raw stream ends early"),
    ("padding", "padding"),
    ("escapes-short", "escapes stream ends early"),
    ("escapes-left", "left over in the escapes stream"),
    ("bases-left", "left over in the bases stream"),
    ("raw-left", "left over in the raw stream"),
    ("symbols-left", "left over in the stream"),
])
def test_reader_rejects(case, match, numpy):
    b, s, e, r = _pieces()
    assert e.size == 1
    if case == "base-high":
        b[0] = 194
    elif case == "bases-short":
        b = b[:0]
    elif case == "symbols-short":
        s = s[:-1]
    elif case == "raw-short":
        r = r[:-1]
    elif case == "padding":  # 4099 elements: 2 bits used of the last byte
        r[-1] |= 0x80
    elif case == "escapes-short":
        e = e[:0]
    elif case == "escapes-left":
        e = np.concatenate([e, e])
    elif case == "bases-left":
        b = np.concatenate([b, b])
    elif case == "raw-left":
        r = np.concatenate([r, np.zeros(1, np.uint8)])
    else:
        s = np.concatenate([s, s[:1]])
    with pytest.raises(DecodeError, match=match):
        _read([b, s, e, r], numpy=numpy)


def test_flipped_bits_change_the_values_or_are_caught():
    """A bit flipped in the base, symbols or escapes is caught or changes the values (which the
    tensor digest then catches): never a crash, never a read past a stream."""
    u = weights(5003, seed=9)
    u[100] = 0x7000
    pieces = fullexp.encode(u)
    for s in range(3):
        for byte in range(0, pieces[s].size, max(1, pieces[s].size // 40)):
            for bit in (0, 3, 7):
                bad = [p.copy() for p in pieces]
                bad[s][byte] ^= 1 << bit
                try:
                    got = _read(bad, u.size)
                except DecodeError:
                    continue
                assert not np.array_equal(got, u)


# --- the piecewise stream reader ----------------------------------------------------------------
def _frame(data: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=True, **kw).compress(data)


@pytest.mark.parametrize("data", [bytes(range(256)) * 2000, b"\7" * 700_000, b"", b"x",
                                  np.random.default_rng(1).integers(0, 9, 300_001, dtype=np.uint8).tobytes()])
@pytest.mark.parametrize("checksum", [False, True])
def test_stream_reader_takes_what_decompress_gives(data, checksum):
    frame = _frame(data, write_checksum=checksum)
    from xcluster.format.zframe import frame_length

    assert frame_length(frame + b"tail", where="t") == len(frame)
    whole = streams.decompress("zstd", frame, len(data), where="t")
    r = streams.Reader("zstd", frame, len(data), where="t")
    got, k = [], 1
    while r.left():
        got.append(r.take(min(k, r.left())).copy())
        k = k * 3 + 1
    r.finish()
    assert b"".join(x.tobytes() for x in got) == whole.tobytes() == data
    with pytest.raises(DecodeError, match="ends early"):
        r.take(1)


def test_stream_reader_refuses_what_decompress_refuses():
    data = bytes(range(256)) * 1000
    frame = _frame(data, write_checksum=True)
    n = len(data)
    for payload, raw_len, error, says in [
        (frame + b"\0", n, DecodeError, "unused data"),
        (frame + frame, n, DecodeError, "unused data"),
        (frame[:-5], n, DecodeError, "cut short"),
        (frame, n - 1, DecompressionBombError, "declares"),
        (frame, n + 1, DecodeError, "declares"),
        (b"not a frame at all", n, DecodeError, "not a zstd frame"),
        (b"raw", 4, DecodeError, "raw stream holds 3"),
    ]:
        with pytest.raises(error, match=says):
            streams.Reader("raw" if payload == b"raw" else "zstd", payload, raw_len, where="t")
    bad = bytearray(frame)
    bad[-1] ^= 0xFF  # the checksum: found when the frame ends
    r = streams.Reader("zstd", bytes(bad), n, where="t")
    with pytest.raises(DecodeError, match="corrupt"):
        r.take(n)
        r.finish()
    r = streams.Reader("zstd", frame, n, where="t")
    r.take(n - 1)
    with pytest.raises(DecodeError, match="1 bytes left over"):
        r.finish()


def test_stream_reader_catches_a_frame_that_lies_about_its_size():
    """A header re-written to declare fewer bytes than the frame holds: a bomb, found before more
    than was asked for is inflated."""
    data = bytes(range(256)) * 20  # 5120 bytes
    frame = _frame(data)
    assert frame[4] >> 6 == 1 and frame[4] & 0x20  # single segment, 2-byte content size (value - 256)
    lying = frame[:5] + (1000 - 256).to_bytes(2, "little") + frame[7:]
    r = streams.Reader("zstd", lying, 1000, where="t")
    with pytest.raises(DecompressionBombError, match="inflates past"):
        r.take(1000)
        r.finish()


# --- through the publisher (and tests/unit/test_full_values.py) -------------------------------
def test_without_the_flag_planes_are_written_and_numpy_writes_the_same():
    gen = torch.Generator().manual_seed(2)
    sd = state(gen)
    store = memory_store()
    Publisher(store=store, config=PublisherConfig(codec=CodecConfig(encodings=CORE_ENCODINGS))).publish(sd)
    sub = Subscriber(store=store)
    sub.sync()
    assert {b.encoding for b in sub.manifest.blocks} == {PLANES}
    assert sub.manifest.encodings == (PLANES,)

    def objects():
        chunks: list = []
        enc = encode_version(sd, {n: f"{i:032x}" for i, n in enumerate(sorted(sd))}, None,
                             CodecConfig(), lambda e, d: chunks.append((e, bytes(d))))
        return chunks, enc.blocks

    want = objects()
    assert FULL_EXP in {b.encoding for b in want[1]}
    with mock.patch.object(fullexp, "_kernels", lambda: None):  # no numba: the numpy loops
        assert objects() == want


def test_more_escapes_than_elements_is_a_bomb():
    from xcluster import format as fmt

    store, _, _ = published(state(torch.Generator().manual_seed(3)), CodecConfig())
    bad = json.loads(manifest_bytes(store, 1))
    blk = [b for b in bad["blocks"] if b["encoding"] == FULL_EXP][0]
    blk["streams"][2][2] = sum(s[2] for s in blk["segments"]) + 1
    with pytest.raises(DecompressionBombError, match="stream 2 declares"):
        parse_manifest(fmt.canonical_json(bad))

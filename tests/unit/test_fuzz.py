"""Fuzzing the parsers (manifest, HEAD, lease) and the block decoders, for a bounded time.

Inputs start from valid objects written by the real Publisher, so mutations reach deep code
paths. The property: only the library's own errors (``XclusterError`` subclasses) escape, and no
example allocates more than its declared and checked sizes allow (tracemalloc around each one).
Each fuzz test also counts where its examples ended, and asserts that both the accepting and the
refusing paths were reached, so a strategy that never gets past the first check fails loudly.
"""

from __future__ import annotations

import functools
import json
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig

from xcluster.read.chain import find_link, read_head
from xcluster.codec.decode import Fill, decode_block, fill, patch
from xcluster.codec.encoding import get
from xcluster.codec.encodings import sparse_exp2
from xcluster.codec.dtypes import torch_dtype
from xcluster.errors import DecodeError, XclusterError
from xcluster.format import HEAD_KEY, Lease, chunk_key, parse_head, parse_lease, parse_manifest, xxh3_128
from xcluster.format.packing import unpack
from tests.unit.helpers import memory_store
DENSE_SUB, PLANES, SPARSE_EXP2, SPARSE_SUB = "dense-sub", "planes", "sparse-exp2", "sparse-sub"

MiB = 1 << 20
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- valid objects from the real writer ---------------------------------------------------------
@dataclass(frozen=True)
class Written:
    manifests: dict[int, bytes]
    chunks: dict[int, list[bytes]]
    head: bytes


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    st_ = {"a.bf16": torch.randn(16, 48, generator=g).to(torch.bfloat16),   # no tensor spans a block
           "b.f32": torch.randn(300, generator=g),
           "c.i64": torch.randint(-9, 9, (60,), generator=g),
           "d.u8": torch.randint(0, 255, (500,), generator=g, dtype=torch.uint8),
           "e.bool": torch.rand(40, generator=g) > 0.5}
    if step:
        st_["a.bf16"].view(torch.int16).reshape(-1)[::37] += 1      # sparse
        st_["b.f32"] += 1.0                                          # dense
        st_["c.i64"][::7] += step                                    # sparse, width 8
        st_["d.u8"][:400] += 1                                       # dense, width 1
        st_["e.bool"][::3] = ~st_["e.bool"][::3]
    return st_


@functools.lru_cache(maxsize=1)
def written() -> Written:
    store = memory_store()
    pub = Publisher(store=store, config=PublisherConfig(
        keyframe_every=100, checkpoint_chain_fraction=None,
        codec=CodecConfig(block_bytes=4096, chunk_bytes=8192, dense_threshold=0.3)))
    pub.publish(_state(0))
    # sparse-exp2 even for a.bf16's 21 changes (writers try it from EXP_MIN_CHANGES on; a reader
    # decodes a segment of any size), so this small corpus holds a block of it
    with mock.patch.object(sparse_exp2, "MIN_CHANGES", 1):
        pub.publish(_state(1))
    head, _ = read_head(store)
    manifests, chunks = {}, {}
    for v in (1, 2):
        key = find_link(store, head, v).key
        manifests[v] = unpack(store.get(key).data, where=key)  # the canonical JSON the parser reads
        m = parse_manifest(manifests[v])
        chunks[v] = [store.get(chunk_key(v, c.name)).data for c in m.chunks]
    return Written(manifests, chunks, store.get(HEAD_KEY).data)


def test_written_objects_hold_every_encoding_and_width():
    w = written()
    kinds = {(b.encoding, b.width) for v in (1, 2) for b in parse_manifest(w.manifests[v]).blocks}
    # the fuzzers reach every decoder the writer uses (sparse-exp, read only now: test_roundtrip.py)
    assert {e for e, _ in kinds} == {PLANES, SPARSE_SUB, DENSE_SUB, SPARSE_EXP2}
    assert {wd for e, wd in kinds if e == PLANES} == {1, 2, 4, 8}
    assert any(b.streams[0].codec == "zstd" for b in parse_manifest(w.manifests[2]).blocks)


# --- JSON mutations -----------------------------------------------------------------------------
SPLICE = "@@splice-{}@@"
SPECIAL_TEXT = ["9" * 5000, "-" + "9" * 400, "1e400", "-0", "1.0", "NaN", "Infinity", "[" * 50_000 + "]" * 50_000,
                '{"a":' * 5000 + "1" + "}" * 5000, '"\\ud800"', '"\\u0000"']
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                      st.sampled_from([0, 1, -1, (1 << 53) - 1, 1 << 53, 1 << 63, 1 << 64, 1 << 36, (1 << 31) + 1]),
                      st.floats(allow_nan=False), st.text(max_size=20),
                      st.sampled_from(["", "..", "../x", "/abs", "a/b", "x\0", "manifest.json", "zstd", "raw",
                                       "planes", "sparse-sub", "dense-sub", "keyframe", "delta", "none", "base",
                                       "bfloat16", "bool", "0" * 32, "f" * 33, "x" * 600]))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner,
                                                                             max_size=4)), max_leaves=12)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated_json(draw, data: bytes) -> bytes:
    """``data`` (a canonical JSON object) with 1-3 structural mutations, or byte-level damage."""
    if draw(st.integers(0, 4)) == 0:  # byte level: flips, cuts, insertions
        b = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            i = draw(st.integers(0, max(len(b) - 1, 0)))
            if op == "flip" and b:
                b[i] ^= draw(st.integers(1, 255))
            elif op == "cut":
                del b[i:i + draw(st.integers(1, 64))]
            else:
                b[i:i] = draw(st.binary(min_size=1, max_size=16))
        return bytes(b)
    obj = json.loads(data)
    splices: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(obj)))
        if not path:
            continue
        parent = obj
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = draw(st.sampled_from(["delete", "replace", "replace", "special", "duplicate", "tweak"]))
        if action == "delete":
            del parent[key]
        elif action == "replace":
            parent[key] = draw(json_value)
        elif action == "special":
            splices.append(draw(st.sampled_from(SPECIAL_TEXT)))
            parent[key] = SPLICE.format(len(splices) - 1)
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
        elif action == "tweak" and type(parent[key]) is int:
            parent[key] += draw(st.sampled_from([-1, 1, 1 << 31, 1 << 36, -(1 << 40)]))
    text = json.dumps(obj, sort_keys=draw(st.booleans()), separators=(",", ":"))
    for i, frag in enumerate(splices):
        text = text.replace(json.dumps(SPLICE.format(i)), frag)
    return text.encode()


def bounded(fn, *args, limit: int):
    """``fn(*args)`` under tracemalloc: returns (result or the XclusterError raised, peak bytes).
    Anything else propagates: hypothesis reports the input."""
    tracemalloc.start()
    try:
        try:
            out = fn(*args)
        except XclusterError as exc:
            out = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= limit, f"peak {peak} bytes > {limit}"
    return out


def _outcome(x: Any) -> str:
    return type(x).__name__ if isinstance(x, BaseException) else "accepted"


@pytest.mark.parametrize("which, parse, examples", [
    ("manifest_keyframe", parse_manifest, 450),
    ("manifest_delta", parse_manifest, 450),
    ("head", parse_head, 350),
    ("lease", parse_lease, 350),
])
def test_fuzz_parsers(which, parse, examples):
    w = written()
    seed = {"manifest_keyframe": w.manifests[1], "manifest_delta": w.manifests[2], "head": w.head,
            "lease": Lease("node-1", 3, 4, "0" * 32, 1_700_000_000_000, "ok", 3, "boom", 1_700_000_000_000,
                           4).to_bytes()}[which]
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=examples)
    @given(st.data())
    def run(data):
        blob = data.draw(mutated_json(seed))
        # parsing builds Python objects from the input: a generous constant per input byte
        seen[_outcome(bounded(parse, blob, limit=1 * MiB + 64 * len(blob)))] += 1

    run()
    assert seen["accepted"] > 0 and seen["FormatError"] > 0, seen
    assert sum(seen.values()) >= examples // 2, seen


# --- block decoders -------------------------------------------------------------------------------
def _payloads(m, chunks: list[bytes]) -> list[list[bytes]]:
    out = []
    for b in m.blocks:
        off, ps = b.offset, []
        for s in b.streams:
            ps.append(chunks[b.chunk][off:off + s.stored])
            off += s.stored
        out.append(ps)
    return out


def relayout(obj: dict, payloads: list[list[bytes]]) -> list[bytes]:
    """Lay every block's streams back to back in its chunk again (offsets, sizes, hashes follow)."""
    out = []
    for ci, c in enumerate(obj["chunks"]):
        pos, parts = 0, []
        for bi in sorted((i for i, b in enumerate(obj["blocks"]) if b["chunk"] == ci),
                         key=lambda i: obj["blocks"][i]["offset"]):
            obj["blocks"][bi]["offset"] = pos
            for k, p in enumerate(payloads[bi]):
                parts.append(p)
                obj["blocks"][bi]["streams"][k][1] = len(p)
                pos += len(p)
        data = b"".join(parts)
        c.update(size=len(data), xxh3_128=xxh3_128(data))
        out.append(data)
    return out


def with_content_size(frame: bytes, declared: int) -> bytes:
    fhd = frame[4]
    size = [1 if fhd & 0x20 else 0, 2, 4, 8][fhd >> 6]
    off = 5 + (0 if fhd & 0x20 else 1) + [0, 1, 2, 4][fhd & 3]
    if size not in (4, 8) or declared >= 1 << (8 * size):
        return frame
    return frame[:off] + declared.to_bytes(size, "little") + frame[off + size:]


@functools.lru_cache(maxsize=1)
def bomb_frame() -> bytes:
    return zstandard.ZstdCompressor().compress(b"\0" * (64 * MiB))


@st.composite
def stream_payload(draw, orig: bytes, raw: int) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["keep", "flip", "cut", "random", "zstd", "zstd_lies", "zstd_bomb"]))
    if kind == "keep":
        return "keep", orig
    if kind == "flip" and orig:
        b = bytearray(orig)
        for _ in range(draw(st.integers(1, 3))):
            b[draw(st.integers(0, len(b) - 1))] ^= draw(st.integers(1, 255))
        return "keep", bytes(b)
    if kind == "cut":
        return "keep", orig[:draw(st.integers(0, len(orig)))]
    if kind == "random":
        return draw(st.sampled_from(["raw", "zstd"])), draw(st.binary(max_size=raw + 8))
    n = draw(st.sampled_from([raw, raw, max(raw - 1, 0), raw + 1, draw(st.integers(0, 2 * raw + 8))]))
    body = draw(st.sampled_from([b"\0" * n, bytes(range(256)) * (n // 256) + bytes(n % 256)]))
    if kind == "zstd_bomb":  # 64 MiB of zeros behind a header that declares raw
        return "zstd", with_content_size(bomb_frame(), raw)
    frame = zstandard.ZstdCompressor(write_content_size=draw(st.booleans())).compress(body)
    return "zstd", with_content_size(frame, raw) if kind == "zstd_lies" else frame


@st.composite
def mutated_block(draw, version: int, encoding: str):
    """(manifest bytes, chunks, block index): one block of ``encoding`` with its streams and
    possibly its descriptor (segments, raw sizes, codec, width) mutated; the rest stays valid."""
    w = written()
    obj = json.loads(w.manifests[version])
    m = parse_manifest(w.manifests[version])
    payloads = _payloads(m, w.chunks[version])
    bi = draw(st.sampled_from([i for i, b in enumerate(m.blocks) if b.encoding == encoding]))
    blk = obj["blocks"][bi]
    if draw(st.integers(0, 3)) == 0:  # descriptor: segments first, then sizes that agree with them
        for seg in blk["segments"]:
            field = draw(st.integers(0, 3))
            seg[field] = max(0, seg[field] + draw(st.sampled_from([-1, 1, -seg[field], 1 << 31, 7])))
        try:
            raws = [n for n, _ in get(encoding).stream_lengths(
                blk["width"], [type("S", (), dict(count=s[2], nnz=s[3])) for s in blk["segments"]],
                [obj["tensors"][s[0]]["dtype"] for s in blk["segments"]])]
        except Exception:  # noqa: BLE001 - not our code under test: a strategy helper
            raws = [s[2] for s in blk["streams"]]
        if max(raws) <= 1 << 20:
            blk["streams"] = [["raw", r, r] for r in raws]
            payloads[bi] = [draw(st.binary(min_size=r, max_size=r)) for r in raws]
    if draw(st.integers(0, 5)) == 0:
        blk[draw(st.sampled_from(["width", "encoding"]))] = draw(st.sampled_from([1, 2, 4, 8, 3, PLANES, SPARSE_SUB,
                                                                                 DENSE_SUB]))
    targets = draw(st.sets(st.integers(0, len(blk["streams"]) - 1), max_size=2))
    for k, s in enumerate(blk["streams"]):
        if k not in targets:
            continue
        codec, payload = draw(stream_payload(payloads[bi][k], s[2]))
        payloads[bi][k] = payload
        if codec != "keep":
            s[0] = codec
        if draw(st.integers(0, 9)) == 0:
            s[0] = draw(st.sampled_from(["zstd", "raw", "lz4", 7, None]))
        if draw(st.integers(0, 9)) == 0:
            s[2] = draw(st.sampled_from([0, s[2] - 1, s[2] + 1, 1 << 36, 64 * MiB]))
    chunks = relayout(obj, payloads)
    return json.dumps(obj).encode(), chunks, bi


@pytest.fixture(scope="module", autouse=True)
def compiled_loops_loaded():
    """The patch loops compiled (or loaded from numba's cache) for every width a mutated block can
    declare before any example runs: compiling inside tracemalloc's window would count the
    compiler's memory against the decoder (whether it happens there depended on which tests ran
    earlier in the process)."""
    import numpy as np

    from xcluster.codec.kernels.scatter import scatter_add
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        bits = np.zeros(4, dtype=dt)
        for subtract in (False, True):
            scatter_add(bits, np.array([1], dtype=np.int64), np.array([1], dtype=dt), subtract=subtract)


def decode_and_apply(mbytes: bytes, chunks: list[bytes], bi: int) -> None:
    m = parse_manifest(mbytes)
    b = m.blocks[bi]
    ops = decode_block(b, chunks[b.chunk], m.tensors, where=f"block {bi}")
    for op in ops:
        t = m.tensors[op.tensor]
        target = torch.zeros(t.shape, dtype=torch_dtype(t.dtype))
        fill(target, op) if isinstance(op, Fill) else patch(target, op)


@pytest.mark.parametrize("version, encoding, examples", [
    (1, PLANES, 450),
    (2, SPARSE_SUB, 600),
    (2, DENSE_SUB, 450),
])
def test_fuzz_decoders(version, encoding, examples):
    seen: Counter = Counter()

    @settings(FUZZ, max_examples=examples)
    @given(mutated_block(version, encoding))
    def run(case):
        mbytes, chunks, bi = case
        try:
            declared = sum(s.raw for s in parse_manifest(mbytes).blocks[bi].streams)
        except XclusterError as exc:
            seen[f"parse:{type(exc).__name__}"] += 1
            return
        # decoding holds the decoded streams and, per element, a few int64 temporaries
        out = bounded(decode_and_apply, mbytes, chunks, bi, limit=1 * MiB + 48 * declared)
        seen[_outcome(out)] += 1

    run()
    assert seen["accepted"] > 0, seen
    assert seen["DecodeError"] + seen["DecompressionBombError"] > 0, seen
    assert sum(v for k, v in seen.items() if k.startswith("parse:")) > 0, seen


def test_sparse_positions_past_the_segment_are_a_decode_error():
    """A regression anchor for the fuzzer's sparse path: random gap bytes of the right length
    decode, and positions past the segment end are a DecodeError (never an IndexError)."""
    w = written()
    m = parse_manifest(w.manifests[2])
    bi = next(i for i, b in enumerate(m.blocks) if b.encoding == SPARSE_SUB)
    obj = json.loads(w.manifests[2])
    blk = obj["blocks"][bi]
    payloads = _payloads(m, w.chunks[2])
    raws = [s[2] for s in blk["streams"]]
    blk["streams"] = [["raw", r, r] for r in raws]
    payloads[bi] = [b"\xff" * r for r in raws]  # every gap 2**32 - 1
    chunks = relayout(obj, payloads)
    with pytest.raises(DecodeError, match="outside its segment"):
        decode_and_apply(json.dumps(obj).encode(), chunks, bi)

"""Whole bf16 values written as ``full-exp`` (FORMAT.md §5e), through the publisher and the
subscriber."""

from __future__ import annotations

import json
from dataclasses import replace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec.encodings import full_exp as fullexp
from xcluster.codec.decode import Fill, decode_block
from xcluster.codec.encode import encode_version
from xcluster.codec.dtypes import flat_bits, torch_dtype
from xcluster.errors import DecodeError, DecompressionBombError, FormatError, UnknownEncodingError
from xcluster.codec.encoding import core_names, parse_manifest
from tests.support.encodings import without_encodings
from tests.unit.helpers import assert_state_equal, manifest_bytes, memory_store
from tests.unit.test_roundtrip import SMALL, perturb, random_tensor
from tests.unit.test_roundtrip import roundtrip as publish_roundtrip
FULL_EXP, PLANES = "full-exp", "planes"
CORE_ENCODINGS = core_names()

AVAILABLE = [FULL_EXP]
ENCODINGS = [FULL_EXP]
PIECES = {FULL_EXP: fullexp.encode}


def codec(encoding: str, **kw) -> CodecConfig:
    return CodecConfig(**kw)  # the default allows every encoding


def state(gen):
    return {"w": (torch.randn(300, 257, generator=gen) * 0.02).to(torch.bfloat16),
            "emb": (torch.randn(1000, 64, generator=gen) * 0.05).to(torch.bfloat16),
            "ones": torch.ones(4096, dtype=torch.bfloat16),  # constant: planes are smaller
            "f32": torch.randn(777, generator=gen),  # not bf16: planes
            "f16": torch.randn(500, generator=gen).to(torch.float16),  # not bf16 either
            "tiny": torch.randn(3, generator=gen).to(torch.bfloat16)}


def coded(m, encoding: str) -> set[str]:
    """Names of the tensors with a segment of ``encoding`` in manifest ``m``."""
    return {m.tensors[s.tensor].name for b in m.blocks if b.encoding == encoding for s in b.segments}


def published(sd, cfg: CodecConfig):
    store = memory_store()
    res = Publisher(store=store, config=PublisherConfig(codec=cfg)).publish(sd)
    sub = Subscriber(store=store)
    sub.sync()
    assert_state_equal(sub.state_dict(), sd)
    return store, res, sub.manifest


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_keyframes_and_new_tensors_are_coded_and_late_joiners_agree(encoding):
    gen = torch.Generator().manual_seed(1)
    cur = state(gen)
    store = memory_store()
    cfg = codec(encoding, block_bytes=32 << 10, chunk_bytes=64 << 10)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3, codec=cfg))
    follower = Subscriber(store=store)
    joiners = []
    for i in range(7):
        if i == 4:
            cur["new"] = (torch.randn(5000, generator=gen) * 0.1).to(torch.bfloat16)
        res = pub.publish(cur, step=i)
        assert follower.sync() == res.version
        assert_state_equal(follower.state_dict(), cur)
        m = follower.manifest
        if res.kind == "keyframe":
            joiners.append(Subscriber(store=store))
            assert coded(m, encoding) == {"w", "emb"} | ({"new"} if "new" in cur else set())
            assert coded(m, PLANES) == {"ones", "f32", "f16", "tiny"}
            assert m.encodings == (FULL_EXP, PLANES)
        else:
            assert coded(m, encoding) == ({"new"} if i == 4 else set())
        for j in joiners:
            assert j.sync() == res.version
            assert j.model_digest == follower.model_digest
        cur = {k: (v.float() + torch.randn(v.shape, generator=gen) * 1e-3).to(v.dtype) for k, v in cur.items()}
    assert len(joiners) == 3


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_old_readers_and_bad_manifests_are_refused(encoding):
    from xcluster import format as fmt

    store, _, _ = published(state(torch.Generator().manual_seed(3)), codec(encoding))
    data = manifest_bytes(store, 1)
    obj = json.loads(data)
    assert obj["encodings"] == [FULL_EXP, PLANES]
    with without_encodings(encoding):  # a reader without the encoding
        with pytest.raises(UnknownEncodingError, match=f"uses encoding '{encoding}'"):
            parse_manifest((data))
    with pytest.raises(FormatError, match=f"encoding '{encoding}' is not one the manifest's 'encodings' lists"):
        fmt.parse_manifest(fmt.canonical_json(dict(obj, encodings=[PLANES])))
    with pytest.raises(FormatError, match="its blocks use"):
        fmt.parse_manifest(fmt.canonical_json(dict(obj, encodings=sorted([FULL_EXP, PLANES, "sparse-sub"]))))

    def block(o):
        return [b for b in o["blocks"] if b["encoding"] == encoding][0]

    bad = json.loads(data)  # a segment on a tensor of another dtype
    f16 = [i for i, t in enumerate(bad["tensors"]) if t["dtype"] == "float16"][0]
    block(bad)["segments"][0] = [f16, 0, 100, 100]
    with pytest.raises(FormatError, match="only bfloat16"):
        parse_manifest((fmt.canonical_json(bad)))
    # a declared raw length other than the segments fix: the raw fields, then the symbols
    for stream in (3, 1):
        for delta in (1, -1):
            bad = json.loads(data)
            block(bad)["streams"][stream][2] += delta
            with pytest.raises((FormatError, DecompressionBombError), match=f"stream {stream} declares"):
                parse_manifest((fmt.canonical_json(bad)))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_block_reads_every_segment_into_the_tensors_given(encoding):
    """Several tensors' segments in one block, decoded in order, into the tensors given (no
    operations) or as Fill operations; the block's streams must be used up."""
    gen = torch.Generator().manual_seed(4)
    sd = {f"t{i}": (torch.randn(2000 + i, generator=gen) * 0.02).to(torch.bfloat16) for i in range(5)}
    store, _, m = published(sd, codec(encoding))
    (blk,) = [b for b in m.blocks if b.encoding == encoding]
    assert len(blk.segments) == 5
    chunk = store.get(f"versions/{1:012d}/{m.chunks[blk.chunk].name}").data
    ops = decode_block(blk, chunk, m.tensors, where="t")
    assert [op.tensor for op in ops] == [s.tensor for s in blk.segments] and all(isinstance(o, Fill) for o in ops)
    into = {1: torch.zeros(2001, dtype=torch.bfloat16), 3: torch.zeros(2003, dtype=torch.bfloat16)}
    ops = decode_block(blk, chunk, m.tensors, where="t", into=into)
    assert [op.tensor for op in ops] == [0, 2, 4]
    assert torch.equal(flat_bits(into[1]), flat_bits(sd["t1"])) and torch.equal(flat_bits(into[3]), flat_bits(sd["t3"]))
    short = replace(blk, segments=blk.segments[:-1])  # the streams hold bytes nobody reads
    with pytest.raises(DecodeError):
        decode_block(short, chunk, m.tensors, where="t")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(encoding=st.sampled_from(AVAILABLE), dtype=st.sampled_from(["bfloat16", "float16", "float32", "bool", "int8"]),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
       density=st.sampled_from([0.0, 0.01, 0.5, 1.0]), seed=st.integers(0, 2**31 - 1), force=st.booleans())
def test_property_keyframes_any_dtype_shape(encoding, dtype, shape, density, seed, force):
    """The hypothesis round trip with the encoding's flag on and a keyframe every other version;
    forced, every bf16 range of whole values is written in it whether it is smaller or not,
    however short."""
    gen = torch.Generator().manual_seed(seed)
    dt = torch_dtype(dtype)
    cur = {"a": random_tensor(dt, shape, gen), "b": random_tensor(dt, (64, 67), gen)}
    versions = [cur]
    for _ in range(3):
        cur = {k: perturb(v, density, gen) for k, v in cur.items()}
        versions.append(cur)
    cfg = SMALL
    if force:  # every length, down to one element
        with mock.patch.object(type(fullexp.ENCODING), "offer", lambda self, r, best, stored, cfg: PIECES[encoding](r.bits)), \
                mock.patch.object(fullexp, "MIN_ELEMENTS", 1):
            publish_roundtrip(versions, keyframe_every=2, codec=cfg)
    else:
        publish_roundtrip(versions, keyframe_every=2, codec=cfg)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_torch_scan_writes_the_numpy_bytes(encoding):
    """A keyframe and a new tensor scanned with torch ops write the same objects as the numpy scan."""
    gen = torch.Generator().manual_seed(5)
    base = state(gen)
    new = dict(base, added=(torch.randn(7000, generator=gen) * 0.01).to(torch.bfloat16))

    def objects(sd, old, scan):
        chunks: list = []
        enc = encode_version(sd, {n: f"{i:032x}" for i, n in enumerate(sorted(sd))}, old,
                             codec(encoding, scan=scan, block_bytes=16 << 10, chunk_bytes=32 << 10),
                             lambda e, d: chunks.append((e, bytes(d))))
        return chunks, enc.tensors, enc.blocks

    for sd, old in ((base, None), (new, base)):
        want = objects(sd, old, "numpy")
        assert encoding in {b.encoding for b in want[2]}
        assert objects(sd, old, "torch") == want

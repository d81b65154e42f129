"""Bad input: every corruption gets its own named error, nothing is applied, nothing is lost."""

from __future__ import annotations

from dataclasses import replace
import json

import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.errors import (BaseMismatchError, ChainBrokenError, ChecksumMismatchError, DecodeError,
                             DecompressionBombError, FormatError, LegacyFormatError, SchemaVersionError,
                             TruncatedObjectError,
                             UnsafeNameError, XclusterError)
from xcluster.format import HEAD_KEY, chunk_key, parse_head, parse_manifest, xxh3_128
from xcluster.codec.encoding import core_names
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, follow_blocks, make_weights, manifest_bytes, mkey, put_manifest
CORE_ENCODINGS = core_names()


def weights(step: int) -> dict[str, torch.Tensor]:
    """Version ``step`` differs from the base in about 2000 elements of ``w`` (each by ``step`` ulps)."""
    return {**make_weights(step, seed=100, shapes={"w": (256, 256)}, changed=2000, cumulative=False, bump="step"),
            "b": torch.full((16,), float(step))}


@pytest.fixture
def env(tmp_path):
    store = LocalStore(tmp_path / "store")
    # the core encodings (sparse-sub, dense-sub) these tests break by hand; sparse-exp2's own
    # checks are in test_roundtrip.py
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100,
                                                        codec=CodecConfig(encodings=CORE_ENCODINGS)))
    sub = Subscriber(store=store)
    pub.publish(weights(0), step=0)
    assert sub.sync() == 1
    pub.publish(weights(1), step=1)  # version 2, a delta: the one the tests break
    return store, pub, sub


def rewrite_manifest(store, version: int, mutate) -> None:
    """What an attacker with write access would do: change a manifest and keep HEAD consistent."""
    obj = json.loads(manifest_bytes(store, version))
    before = obj.get("encodings")
    mutate(obj)
    follow_blocks(obj, before)
    data = json.dumps(obj).encode()
    put_manifest(store, mkey(store, version), data)
    head = parse_head(store.get(HEAD_KEY).data)
    store.put(HEAD_KEY, replace(head, manifest_xxh3_128=xxh3_128(data)).to_bytes())


def assert_untouched(sub, before_digest):
    assert sub.version == 1
    assert sub.model_digest == before_digest
    assert_state_equal(sub.state_dict(), weights(0))


def first_chunk(store, version: int) -> str:
    m = parse_manifest(manifest_bytes(store, version))
    return chunk_key(version, m.chunks[0].name)


def test_corrupted_chunk_byte(env):
    store, _, sub = env
    before = sub.model_digest
    key = first_chunk(store, 2)
    data = bytearray(store.get(key).data)
    data[len(data) // 2] ^= 0x10
    store.put(key, bytes(data))
    with pytest.raises(ChecksumMismatchError) as ei:
        sub.sync()
    assert key in str(ei.value)
    assert_untouched(sub, before)


def test_truncated_chunk(env):
    store, _, sub = env
    before = sub.model_digest
    key = first_chunk(store, 2)
    store.put(key, store.get(key).data[:-5])
    with pytest.raises(TruncatedObjectError, match=key):
        sub.sync()
    assert_untouched(sub, before)


def test_missing_chunk(env):
    store, _, sub = env
    before = sub.model_digest
    store.delete(first_chunk(store, 2))
    with pytest.raises(ChainBrokenError, match="missing"):
        sub.sync()
    assert_untouched(sub, before)


def test_repaired_chunk_then_applies(env):
    store, _, sub = env
    key = first_chunk(store, 2)
    good = store.get(key).data
    store.put(key, good[:-1])
    with pytest.raises(TruncatedObjectError):
        sub.sync()
    store.put(key, good)
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), weights(1))


@pytest.mark.parametrize("payload, error", [
    (b"{not json", FormatError),
    (b"\xff\xfe\x00", FormatError),
    (b"[1, 2]", FormatError),
    (json.dumps({"format": "xcluster-manifest", "format_version": 99}).encode(), SchemaVersionError),
    (json.dumps({"format": "xcluster-manifest", "schema_version": 7}).encode(), LegacyFormatError),
    (json.dumps({"format": "something-else", "format_version": 1}).encode(), FormatError),
])
def test_manifest_not_json_or_wrong_schema(env, payload, error):
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, lambda o: None)  # keep HEAD consistent with whatever we write next
    put_manifest(store, mkey(store, 2), payload)
    head = parse_head(store.get(HEAD_KEY).data)
    store.put(HEAD_KEY, replace(head, manifest_xxh3_128=xxh3_128(payload)).to_bytes())
    with pytest.raises(error):
        sub.sync()
    assert_untouched(sub, before)


def test_manifest_tampered_without_head_is_caught_by_hash(env):
    store, _, sub = env
    before = sub.model_digest
    obj = json.loads(manifest_bytes(store, 2))
    obj["step"] = 12345
    put_manifest(store, mkey(store, 2), json.dumps(obj).encode())
    with pytest.raises(ChecksumMismatchError, match="manifest"):
        sub.sync()
    assert_untouched(sub, before)


@pytest.mark.parametrize("mutate, error", [
    (lambda o: o["chunks"][0].__setitem__("size", -1), FormatError),
    (lambda o: o["chunks"][0].__setitem__("size", 1 << 60), FormatError),
    (lambda o: o["tensors"][0].__setitem__("shape", [-1, 4]), FormatError),
    (lambda o: o["tensors"][0].__setitem__("shape", [1 << 40, 1 << 40]), FormatError),
    (lambda o: o["tensors"][0].__setitem__("name", "../../etc/passwd"), UnsafeNameError),
    (lambda o: o["tensors"][0].__setitem__("name", "/abs/path"), UnsafeNameError),
    (lambda o: o["chunks"][0].__setitem__("name", "../HEAD"), UnsafeNameError),
    (lambda o: o["chunks"][0].__setitem__("name", "/etc/passwd"), UnsafeNameError),
    (lambda o: o["tensors"][0].__setitem__("dtype", "object"), FormatError),
    (lambda o: o.__setitem__("version", "2"), FormatError),
    (lambda o: o.__setitem__("base_version", None), FormatError),
    (lambda o: o["blocks"][0].__setitem__("offset", 1 << 30), FormatError),
    (lambda o: o["blocks"][0]["segments"][0].__setitem__(2, 1 << 40), FormatError),
    (lambda o: o["blocks"][0]["segments"].append(list(o["blocks"][0]["segments"][0])), FormatError),
])
def test_manifest_bad_fields(env, mutate, error):
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, mutate)
    with pytest.raises(error):
        sub.sync()
    assert_untouched(sub, before)


def test_declared_decoded_size_larger_than_tensor_is_a_bomb(env):
    store, _, sub = env
    before = sub.model_digest

    def inflate(o):
        b = o["blocks"][0]
        b["streams"][0][2] = 256 * 256 * 2 * 1000  # far more than dtype x shape can hold
    rewrite_manifest(store, 2, inflate)
    with pytest.raises(DecompressionBombError):
        sub.sync()
    assert_untouched(sub, before)


def test_zstd_frame_larger_than_declared_is_a_bomb(env):
    """The manifest stays honest, but the chunk holds a frame that would inflate past it."""
    import zstandard

    store, _, sub = env
    before = sub.model_digest
    m = json.loads(manifest_bytes(store, 2))
    bi = max(range(len(m["blocks"])), key=lambda i: m["blocks"][i]["streams"][0][2])
    blk = m["blocks"][bi]
    codec, stored, raw = blk["streams"][0]
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (raw * 100))
    key = chunk_key(2, m["chunks"][blk["chunk"]]["name"])
    data = store.get(key).data
    off = blk["offset"]
    new = data[:off] + bomb + data[off + stored:]
    store.put(key, new)

    def fix(o):
        o["blocks"][bi]["streams"][0] = ["zstd", len(bomb), raw]
        delta = len(bomb) - stored
        for other in o["blocks"]:
            if other["chunk"] == blk["chunk"] and other["offset"] > off:
                other["offset"] += delta
        o["chunks"][blk["chunk"]]["size"] = len(new)
        o["chunks"][blk["chunk"]]["xxh3_128"] = xxh3_128(new)
    rewrite_manifest(store, 2, fix)
    with pytest.raises(DecompressionBombError):
        sub.sync()
    assert_untouched(sub, before)


def test_positions_outside_segment(env):
    """Gaps that walk past the end of the segment are refused before anything is patched."""
    store, _, sub = env
    before = sub.model_digest

    def shrink(o):
        for b in o["blocks"]:
            if b["encoding"] == "sparse-sub":
                seg = b["segments"][0]
                seg[2] = 2 * seg[3]  # the densest legal count: the last changed position now lies outside
                return
        raise AssertionError("no sparse block")
    rewrite_manifest(store, 2, shrink)
    with pytest.raises(DecodeError, match="outside"):
        sub.sync()
    assert_untouched(sub, before)


def test_wrong_base_version_reloads_from_the_keyframe(env, tmp_path):
    """A subscriber holding another history at the same version number never applies a delta
    onto it: the links back from HEAD do not reach what it holds, so it reloads from the keyframe."""
    store, pub, sub = env
    # a subscriber that holds some other history: it was following another prefix
    other = LocalStore(tmp_path / "other")
    Publisher(store=other).publish(weights(5))
    stranger = Subscriber(store=other)
    stranger.sync()
    stranger.store = store  # now pointed at a prefix whose delta 2 builds on a different version 1
    sub.sync()
    assert stranger.sync() == sub.version
    assert stranger.model_digest == sub.model_digest
    assert_state_equal(stranger.state_dict(), sub.state_dict())
    assert stranger.stats.versions_applied == 3  # its own keyframe; then this keyframe 1 and delta 2


def test_delta_on_another_base_is_refused_by_apply(env, tmp_path):
    """The apply step itself refuses a delta whose base link is not what is held."""
    from xcluster.read.chain import Link, read_manifest

    store, pub, sub = env
    other = LocalStore(tmp_path / "other")
    Publisher(store=other).publish(weights(5))
    stranger = Subscriber(store=other)
    stranger.sync()
    stranger.store = store
    from xcluster.format import parse_head
    h = parse_head(store.get("HEAD").data)
    lm = read_manifest(store, Link.of_head(h))
    assert lm.manifest.kind == "delta"
    with pytest.raises(BaseMismatchError):
        stranger._apply(lm.manifest, lm.link.xxh3_128, lm.data, h, where="test")
    assert stranger.version == 1
    assert_state_equal(stranger.state_dict(), weights(5))


def test_digest_mismatch_undoes_patches(env):
    """A delta that decodes but yields other weights than promised is rolled back."""
    from xcluster.errors import DigestMismatchError

    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, lambda o: [t.__setitem__("digest", "0" * 32) for t in o["tensors"]
                                          if t["name"] == "w"])
    with pytest.raises(DigestMismatchError, match="w"):
        sub.sync()
    assert_untouched(sub, before)


def test_all_errors_are_xcluster_errors():
    for cls in (BaseMismatchError, ChainBrokenError, ChecksumMismatchError, DecodeError, DecompressionBombError,
                FormatError, SchemaVersionError, TruncatedObjectError, UnsafeNameError):
        assert issubclass(cls, XclusterError)


def test_publisher_refuses_unsafe_names(tmp_path):
    pub = Publisher(str(tmp_path))
    for bad in ("../x", "/abs", "a/b", "", "a..b", "sp ace"):
        with pytest.raises(UnsafeNameError):
            pub.publish({bad: torch.zeros(2)})
    assert pub.version == 0


def test_oversized_chunk_is_refused_without_reading_it_whole(env):
    store, _, sub = env
    before = sub.model_digest
    key = first_chunk(store, 2)
    store.put(key, store.get(key).data + b"\0" * (4 << 20))
    reads = []
    real = store.get_range

    def spy(k, start, length):
        if k == key:
            reads.append(length)
        return real(k, start, length)
    store.get_range = spy
    with pytest.raises(TruncatedObjectError, match="manifest says"):
        sub.sync()
    assert reads and max(reads) < 1 << 20  # never asked for the 4 MiB
    assert_untouched(sub, before)


def test_persistently_corrupt_delta_recovers_at_next_keyframe(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3))
    sub = Subscriber(store=store)
    pub.publish(weights(0))
    sub.sync()
    pub.publish(weights(1))  # v2: corrupted for good
    key = first_chunk(store, 2)
    store.put(key, b"garbage")
    for _ in range(2):
        with pytest.raises(TruncatedObjectError):
            sub.sync()
        assert sub.version == 1
    pub.publish(weights(2))  # v3 delta: still unreachable, it builds on the bad v2
    with pytest.raises(TruncatedObjectError):
        sub.sync()
    pub.publish(weights(3))  # v4 keyframe: the chain restarts past the corruption
    assert sub.sync() == 4
    assert_state_equal(sub.state_dict(), weights(3))


@pytest.mark.parametrize("workers", [1, 2])
def test_failing_block_after_applied_blocks_is_fully_undone(tmp_path, workers):
    """One block fails to decode while others were already patched in place: all undone."""
    from xcluster import SubscriberConfig

    store = LocalStore(tmp_path)
    pub = Publisher(store=store, config=PublisherConfig(
        keyframe_every=100, codec=CodecConfig(block_bytes=4096, chunk_bytes=1 << 20, dense_threshold=0.05,
                                              encodings=CORE_ENCODINGS)))
    sub = Subscriber(store=store, config=SubscriberConfig(decode_workers=workers))
    g = torch.Generator().manual_seed(9)
    w0 = torch.randn(64, 1024, generator=g).to(torch.bfloat16)
    w1 = w0.clone()
    bits = w1.view(torch.int16).reshape(-1)
    bits[: 32 * 1024] += 1        # dense ranges: many dense-sub blocks
    bits[32 * 1024::97] += 1      # then sparse ranges
    pub.publish({"w": w0})
    sub.sync()
    pub.publish({"w": w1})

    def break_last_sparse(o):
        sparse = [b for b in o["blocks"] if b["encoding"] == "sparse-sub"]
        assert len([b for b in o["blocks"] if b["encoding"] == "dense-sub"]) >= 2 and sparse
        seg = sparse[-1]["segments"][-1]
        seg[2] = 2 * seg[3]  # its last position now lies outside the segment
    rewrite_manifest(store, 2, break_last_sparse)
    with pytest.raises(DecodeError):
        sub.sync()
    assert sub.version == 1
    assert_state_equal(sub.state_dict(), {"w": w0})
    from xcluster.codec.digest import model_digest
    assert model_digest(sub.state_dict()) == sub.model_digest


@pytest.mark.parametrize("mutate", [
    lambda o: o.__setitem__("base_version", 0),  # a delta's base is always version - 1
    lambda o: o["chunks"].append({"name": "cextra-000009.xc", "size": 8, "xxh3_128": "0" * 32}),  # unreferenced
    lambda o: o["chunks"][0].__setitem__("size", o["chunks"][0]["size"] + 1),  # bytes no block covers
])
def test_manifest_structure_rules(env, mutate):
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, mutate)
    with pytest.raises(FormatError):
        sub.sync()
    assert_untouched(sub, before)


def test_deeply_nested_json_is_a_format_error():
    from xcluster.format import parse_head
    with pytest.raises(FormatError):
        parse_manifest(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError):
        parse_head(b"[" * 30_000 + b"]" * 30_000)


def test_hostile_bool_bytes_are_refused(env):
    store, pub, sub = env
    sub.sync()
    pub.publish(dict(weights(1), flags=torch.tensor([True, False, True])))  # v3: a new tensor
    pub.publish(dict(weights(1), flags=torch.tensor([True, True, True])))   # v4: flags patched
    assert sub.sync() == 4
    before = sub.model_digest
    pub.publish(dict(weights(1), flags=torch.tensor([False, True, True])))  # v5
    # a writer with bucket access rewrites v5's flags patch to turn byte 0 from 1 into 2, with
    # digests that agree: only the bool rule can catch it
    import numpy as np
    from xcluster.codec.digest import model_digest_from, tensor_digest
    m = json.loads(manifest_bytes(store, 5))
    fi = [t["name"] for t in m["tensors"]].index("flags")
    blk = next(b for b in m["blocks"] if any(s[0] == fi for s in b["segments"]))
    assert blk["width"] == 1
    bad = torch.tensor([2, 1, 1], dtype=torch.uint8)
    # the block becomes sparse-sub: one change at position 0 by zigzag(+1) = 2 (1 -> 2)
    streams = [np.array([0], np.uint8)] * 4 + [np.array([2], np.uint8)]
    payload = b"".join(bytes(s) for s in streams)
    key = chunk_key(5, m["chunks"][blk["chunk"]]["name"])
    assert len(m["blocks"]) == 1 and len(blk["segments"]) == 1
    blk.update(encoding="sparse-sub", offset=0, streams=[["raw", 1, 1]] * 5, segments=[[fi, 0, 3, 1]])
    store.put(key, payload)
    m["chunks"][blk["chunk"]].update(size=len(payload), xxh3_128=xxh3_128(payload))
    flags_digest = tensor_digest(bad.view(torch.bool))
    for t in m["tensors"]:
        if t["name"] == "flags":
            t["digest"] = flags_digest
    m["model_digest"] = model_digest_from((t["name"], t["dtype"], t["shape"], t["digest"]) for t in m["tensors"])
    rewrite_manifest(store, 5, lambda o: (o.clear(), o.update(m)))
    with pytest.raises(DecodeError, match="bool"):
        sub.sync()
    assert sub.version == 4 and sub.model_digest == before
    assert sub.state_dict()["flags"].tolist() == [True, True, True]

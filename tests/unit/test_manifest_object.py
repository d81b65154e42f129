"""Manifest objects (``manifest-<attempt>.json.zst``, one zstd frame, FORMAT.md §3): written, read,
relayed, listed and collected; hashes and signatures over the canonical JSON; a bad frame is a
named error and the subscriber keeps its weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
import zstandard

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.format import packing as manifest_object
from xcluster.cli import main
from xcluster.errors import (ChecksumMismatchError, DecodeError, DecompressionBombError, FormatError,
                             SchemaVersionError)
from xcluster.format import HEAD_KEY, Head, parse_head, parse_manifest, xxh3_128
from xcluster.format.packing import pack, unpack
from xcluster.fleet.relay import Relay, RelayConfig
from xcluster.fleet.retention import RetentionConfig, gc
from xcluster.trust.signing import generate_keypair
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_weights(step, shapes={f"layers.{i}.w": (64, 48) for i in range(12)}, changed=30, pick="randint")


def publish(store, steps, **kw) -> list:
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=4, checkpoint_chain_fraction=None, **kw))
    return [pub.publish(weights(s), step=s) for s in steps]


def manifest_keys(store) -> list[str]:
    return sorted(k for k in store.list("versions/") if "/manifest-" in k)


# --- the object itself -------------------------------------------------------------------------
def test_pack_round_trips():
    canonical = json.dumps({"tensors": [{"name": f"layers.{i}.weight"} for i in range(200)]}).encode()
    packed = pack(canonical)
    assert packed.startswith(ZSTD_MAGIC) and len(packed) < len(canonical) // 5
    assert zstandard.frame_content_size(packed) == len(canonical)
    assert unpack(packed, where="m") == canonical


def _lying_header(frame: bytes, declared: int) -> bytes:
    """``frame`` (single-segment, 2-byte content size field) re-headed to declare ``declared`` bytes."""
    assert frame[4] >> 6 == 1 and frame[4] & 0x20, "expected a single-segment frame with a 2-byte size"
    return frame[:5] + (declared - 256).to_bytes(2, "little") + frame[7:]


@pytest.mark.parametrize("make, error, says", [
    (lambda f: b'{"format": "xcluster-manifest"}', DecodeError, "not a zstd frame"),
    (lambda f: zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 3000), DecodeError,
     "without a content size"),
    (lambda f: f + b"\0", DecodeError, "unused data"),
    (lambda f: f + f, DecodeError, "unused data"),
    (lambda f: f[:-4], DecodeError, "corrupt zstd frame"),
    (lambda f: _lying_header(f, 1000), DecompressionBombError, "inflates past"),
    (lambda f: _lying_header(f, 5000), DecodeError, "corrupt zstd frame"),
], ids=["json", "no-size", "trailing-byte", "two-frames", "truncated", "header-too-small", "header-too-big"])
def test_a_bad_frame_is_a_named_error(make, error, says):
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(os.urandom(300) + b"x" * 3000)
    with pytest.raises(error, match=says):
        unpack(make(frame), where="m")


def test_a_frame_declaring_more_than_the_manifest_limit_is_refused_before_inflating(monkeypatch):
    monkeypatch.setattr(manifest_object, "MAX_MANIFEST_BYTES", 1000)
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 1001)
    with pytest.raises(DecompressionBombError, match="declares 1001 bytes, over the 1000-byte"):
        unpack(frame, where="m")
    with pytest.raises(FormatError, match="over the 1000-byte limit"):
        unpack(os.urandom(1001), where="m")


def test_head_names_a_manifest_object_of_format_1():
    head = Head(version=2, kind="delta", keyframe_version=1, manifest_xxh3_128="0" * 32, committed_unix_ms=1,
                manifest="manifest-ab.json.zst")
    assert parse_head(head.to_bytes()).manifest == "manifest-ab.json.zst"
    for name in ("manifest-ab.json", "manifest.json", "manifest.json.zst", "../manifest-ab.json.zst"):
        with pytest.raises(FormatError, match="'manifest' is invalid"):
            parse_head(json.dumps(dict(json.loads(head.to_bytes()), manifest=name)).encode())
    bad = dict(json.loads(head.to_bytes()), format_version=2)
    with pytest.raises(SchemaVersionError, match="upgrade"):
        parse_head(json.dumps(bad).encode())


# --- a store written with packed manifests -----------------------------------------------------
def test_publish_and_follow_with_packed_manifests(tmp_path):
    store = LocalStore(tmp_path)
    res = publish(store, range(6))  # keyframes 1 and 5
    head = parse_head(store.get(HEAD_KEY).data)
    assert json.loads(store.get(HEAD_KEY).data)["format_version"] == 1 and head.manifest.endswith(".json.zst")
    keys = manifest_keys(store)
    assert len(keys) == 6 and all(k.endswith(".json.zst") for k in keys)
    for k, r in zip(keys, res):
        stored = store.get(k).data
        assert stored.startswith(ZSTD_MAGIC)
        canonical = zstandard.ZstdDecompressor().decompress(stored)
        m = parse_manifest(canonical)
        assert m.version == r.version and canonical == m.to_bytes()  # the canonical JSON, packed
        if r.version == 6:  # every byte counted: chunks, the packed manifest, HEAD
            assert r.bytes_written == sum(c.size for c in m.chunks) + len(stored) + len(store.get(HEAD_KEY).data)
        if m.base_manifest is not None:
            assert m.base_manifest.endswith(".json.zst")
    assert xxh3_128(zstandard.ZstdDecompressor().decompress(store.get(keys[-1]).data)) == head.manifest_xxh3_128

    sub = Subscriber(store=store)
    for v in range(1, 7):  # version by version: keyframe, deltas, keyframe, delta
        assert sub.sync(until=v) == v
        assert_state_equal(sub.state_dict(), weights(v - 1))
    late = Subscriber(store=store)  # joins at the keyframe
    assert late.sync() == 6 and late.model_digest == sub.model_digest == res[-1].model_digest


def test_the_stored_manifest_is_a_fraction_of_its_canonical_json(tmp_path):
    store = LocalStore(tmp_path)
    publish(store, range(3))
    for k in manifest_keys(store):
        stored = store.get(k).data
        assert len(unpack(stored, where=k)) > 2.5 * len(stored)


def test_signed_packed_manifests_verify(tmp_path):
    key = tmp_path / "key.pem"
    generate_keypair(key)
    store = LocalStore(tmp_path / "s")
    publish(store, range(3), signing_key=str(key))
    m = parse_manifest(unpack(store.get(manifest_keys(store)[-1]).data, where="m"))
    assert m.signature is not None
    sub = Subscriber(store=store, config=SubscriberConfig(trusted_keys=(str(key) + ".pub",)))
    assert sub.sync() == 3


@pytest.mark.parametrize("garble", ["flip-a-byte", "valid-frame-other-bytes"])
def test_a_garbled_packed_manifest_is_refused_and_the_weights_kept(tmp_path, garble):
    store = LocalStore(tmp_path)
    publish(store, range(2))
    sub = Subscriber(store=store)
    assert sub.sync() == 2
    publish_more = Publisher(store=store, config=PublisherConfig(keyframe_every=4))
    publish_more.publish(weights(2), step=2)
    publish_more.publish(weights(3), step=3)  # version 4, a delta on 3
    key = manifest_keys(store)[-1]
    stored = bytearray(store.get(key).data)
    if garble == "flip-a-byte":
        stored[len(stored) // 2] ^= 0x40
    else:  # a well-formed frame of a manifest that is not the one HEAD hashes
        canonical = unpack(bytes(stored), where=key).replace(b'"step":3', b'"step":9')
        stored = bytearray(pack(canonical))
    store.put(key, bytes(stored))
    with pytest.raises(ChecksumMismatchError, match="corrupt or was replaced"):
        sub.sync()
    assert sub.version == 2
    assert_state_equal(sub.state_dict(), weights(1))


def test_ls_gc_and_relay_handle_packed_manifests(tmp_path, capsys):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    publish(src, range(6))
    src.put("versions/000000000007/manifest-dead.json.zst", pack(b"{}"))  # a failed attempt's leftover
    assert main(["ls", str(tmp_path / "src")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[1] for r in rows[:6]] == ["keyframe", "delta", "delta", "delta", "keyframe", "delta"]
    assert rows[5][-1] == "HEAD" and "unreadable" in " ".join(rows[6])

    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(once=True, lease_every_s=0))
    assert r.run() == 0, r.stats.last_error
    assert dst.get(HEAD_KEY).data == src.get(HEAD_KEY).data
    copied = manifest_keys(dst)
    assert len(copied) == 2 and all(dst.get(k).data == src.get(k).data for k in copied)  # packed as stored
    assert Subscriber(store=dst).sync() == 6

    report = gc(src, config=RetentionConfig(grace_s=0), now=lambda: 4e9, apply=True)
    gone = {k for k, _, _ in report.deleted}
    assert "versions/000000000007/manifest-dead.json.zst" in gone
    assert any(k.startswith("versions/000000000001/manifest-") and k.endswith(".json.zst") for k in gone)
    assert Subscriber(store=src).sync() == 6


def test_a_bomb_is_refused_at_once_and_the_weights_kept(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    publish(store, range(1))
    sub = Subscriber(store=store)
    assert sub.sync() == 1
    Publisher(store=store, config=PublisherConfig()).publish(weights(1))
    reads = []
    real_get_range = store.get_range
    monkeypatch.setattr(store, "get_range", lambda k, *a: reads.append(k) or real_get_range(k, *a))
    monkeypatch.setattr(manifest_object, "MAX_MANIFEST_BYTES", 1000)  # this manifest declares more
    with pytest.raises(DecompressionBombError, match="over the 1000-byte manifest limit"):
        sub.sync()
    assert len([k for k in reads if "/manifest-" in k]) == 1  # not re-read as if garbled in transit
    assert sub.version == 1
    assert_state_equal(sub.state_dict(), weights(0))

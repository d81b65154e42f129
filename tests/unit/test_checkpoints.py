"""Checkpoints (FORMAT.md §3a): versions stay deltas, a follower downloads deltas only, a joiner
starts from the newest checkpoint that reproduces its version on the signed chain."""

from __future__ import annotations

import json
import time

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.read.chain import Link, read_head, read_manifest
from xcluster.read.checkpoint import list_checkpoints, read_checkpoint
from xcluster.errors import ChainBrokenError, FormatError
from xcluster.format import CHECKPOINT_PREFIX, Lease, chunk_key, lease_key, parse_manifest
from xcluster.format.packing import pack, unpack
from xcluster.fleet.relay import Relay, RelayConfig
from xcluster.fleet.retention import RetentionConfig, gc
from xcluster.trust.signing import generate_keypair
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights, manifest_bytes

FAR = time.time() + 10 * 86400


def model(step: int) -> dict[str, torch.Tensor]:
    """A bf16 model whose elements drift a few at a time, as under Adam: step s differs from s-1
    in about 1% of ``w``'s elements and in all of ``b``."""
    return {**make_weights(step, shapes={"w": (96, 64)}, changed=60, pick="randint"),
            "b": torch.full((8,), float(step), dtype=torch.bfloat16)}


def publish(store, n: int, *, follower: Subscriber | None = None, **cfg) -> Publisher:
    cfg.setdefault("checkpoint_chain_fraction", None)
    pub = Publisher(store=store, config=PublisherConfig(**cfg))
    for s in range(n):
        pub.publish(model(s))
        if follower is not None:
            assert follower.sync() == s + 1
    return pub


class Reads:
    """Records every key read from a store (get and get_range)."""

    def __init__(self, inner):
        self.inner, self.url, self.keys = inner, inner.url, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key, **kw):
        self.keys.append(key)
        return self.inner.get(key, **kw)

    def get_range(self, key, start, length):
        self.keys.append(key)
        return self.inner.get_range(key, start, length)


def version_chunk_bytes(store, versions) -> int:
    head, _ = read_head(store)
    total, link = 0, Link.of_head(head)
    while link is not None:
        m = read_manifest(store, link).manifest
        if m.version in versions:
            total += m.chunk_bytes
        link = Link.prev_of(m)
    return total


def test_versions_stay_deltas_followers_never_read_a_checkpoint_and_joiners_start_from_the_newest(tmp_path):
    store = LocalStore(tmp_path / "s")
    spy = Reads(store)
    follower = Subscriber(store=spy)
    pub = publish(store, 10, follower=follower, checkpoint_every=4)
    kinds = [read_manifest(store, Link.of_head(read_head(store)[0])).manifest.kind]
    assert kinds == ["delta"] and pub.last_result.kind == "delta"
    assert [c.version for c in list_checkpoints(store)] == [9, 5]
    assert not any(k.startswith(CHECKPOINT_PREFIX) for k in spy.keys)  # not even listed
    assert follower.stats.bytes_fetched == version_chunk_bytes(store, range(1, 11))
    assert follower.stats.checkpoints_applied == 0

    jspy = Reads(store)
    joiner = Subscriber(store=jspy)
    assert joiner.sync() == 10
    assert joiner.stats.checkpoints_applied == 1 and joiner.stats.versions_applied == 2
    cp = read_checkpoint(store, list_checkpoints(store)[0]).manifest
    assert joiner.stats.bytes_fetched == cp.chunk_bytes + version_chunk_bytes(store, {10})
    assert not any(k == chunk_key(9, c.name) for k in jspy.keys for c in cp.chunks)
    assert_state_equal(joiner.state_dict(), model(9))
    assert joiner.model_digest == follower.model_digest
    # the joiner then follows by deltas, like everyone else
    pub.publish(model(10))
    assert joiner.sync() == follower.sync() == 11
    assert_state_equal(joiner.state_dict(), follower.state_dict())
    assert joiner.stats.checkpoints_applied == 1


def _edit_checkpoint(store, version: int, fn) -> None:
    ref = next(r for r in list_checkpoints(store) if r.version == version)
    obj = json.loads(unpack(store.get(ref.key).data, where=ref.key))
    fn(obj)
    store.put(ref.key, pack(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()))


@pytest.mark.parametrize("how", ["claims_other_digests", "decodes_to_other_weights", "names_another_manifest",
                                 "corrupt_chunk", "not_a_manifest"])
def test_a_bad_checkpoint_is_skipped_by_name_and_the_joiner_uses_the_one_before(tmp_path, how, caplog):
    store = LocalStore(tmp_path / "s")
    publish(store, 10, checkpoint_every=4)
    ref = list_checkpoints(store)[0]
    assert ref.version == 9
    cp = read_checkpoint(store, ref).manifest
    if how == "claims_other_digests":  # a forger who rewrote the weights and their digests alike
        _edit_checkpoint(store, 9, lambda o: o["tensors"][0].update(digest="0" * 32))
    elif how == "decodes_to_other_weights":  # the digests of the version, other bytes: caught after decoding
        donor = store.get(chunk_key(1, read_manifest(store, Link(1, _name(store, 1), _hash(store, 1))).manifest
                                    .chunks[0].name)).data
        victim = f"checkpoints/{9:012d}/{cp.chunks[0].name}"
        _edit_checkpoint(store, 9, lambda o: o.update(chunks=o["chunks"]))
        obj = json.loads(unpack(store.get(ref.key).data, where=ref.key))
        store.put(victim, donor)
        import xxhash
        obj["chunks"][0].update(size=len(donor), xxh3_128=xxhash.xxh3_128_hexdigest(donor))
        store.put(ref.key, pack(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()))
    elif how == "names_another_manifest":
        _edit_checkpoint(store, 9, lambda o: o["checkpoint_of"].update(xxh3_128="f" * 32))
    elif how == "corrupt_chunk":
        key = f"checkpoints/{9:012d}/{cp.chunks[0].name}"
        data = bytearray(store.get(key).data)
        data[len(data) // 2] ^= 0xFF
        store.put(key, bytes(data))
    else:
        store.put(ref.key, b"not a manifest")
    joiner = Subscriber(store=store, config=SubscriberConfig(integrity_retries=0))
    assert joiner.sync() == 10
    assert joiner.stats.checkpoints_refused == 1 and joiner.stats.checkpoints_applied == 1
    assert_state_equal(joiner.state_dict(), model(9))
    want = {"claims_other_digests": "CheckpointMismatchError", "names_another_manifest": "CheckpointMismatchError",
            "decodes_to_other_weights": "", "corrupt_chunk": "ChecksumMismatchError", "not_a_manifest": ""}[how]
    assert want in caplog.text and "checkpoint" in caplog.text


def _name(store, v):
    head, _ = read_head(store)
    from xcluster.read.chain import find_link
    return find_link(store, head, v).manifest


def _hash(store, v):
    head, _ = read_head(store)
    from xcluster.read.chain import find_link
    return find_link(store, head, v).xxh3_128


def test_a_follower_behind_retention_rejoins_from_a_checkpoint_and_a_live_lease_keeps_its_deltas(tmp_path):
    store = LocalStore(tmp_path / "s")
    late = Subscriber(store=store)
    leased = Subscriber(store=store)
    pub = publish(store, 2, checkpoint_every=4)
    assert late.sync() == leased.sync() == 2
    for s in range(2, 12):
        pub.publish(model(s))
    store.put(lease_key("leased"), Lease(node_id="leased", version=2, target_version=None, model_digest=None,
                                         updated_unix_ms=int(FAR * 1000)).to_bytes())
    report = gc(store, config=RetentionConfig(grace_s=0, keep_checkpoints=1), now=lambda: FAR, apply=True)
    assert report.protected_by_leases == {"leased": (3, 12)}
    assert leased.sync() == 12 and leased.stats.checkpoints_applied == 0  # deltas 3..12, kept for it
    store.delete(lease_key("leased"))
    gc(store, config=RetentionConfig(grace_s=0, keep_checkpoints=1), now=lambda: FAR, apply=True)
    assert sorted({k.split("/")[1] for k in store.list("versions/")})[0] == f"{9:012d}"
    assert late.sync() == 12 and late.stats.checkpoints_applied == 1
    assert_state_equal(late.state_dict(), leased.state_dict())
    assert Subscriber(store=store).sync() == 12


def test_without_a_checkpoint_a_follower_whose_deltas_are_gone_says_so_and_keeps_its_weights(tmp_path):
    store = LocalStore(tmp_path / "s")
    sub = Subscriber(store=store)
    pub = publish(store, 2, checkpoint_every=None)
    assert sub.sync() == 2
    for s in range(2, 5):
        pub.publish(model(s))
    store.delete(chunk_key(3, read_manifest(store, Link(3, _name(store, 3), _hash(store, 3))).manifest.chunks[0].name))
    store.delete(f"versions/{3:012d}/{_name(store, 3)}")
    with pytest.raises(ChainBrokenError):
        sub.sync()
    assert sub.version == 2
    assert_state_equal(sub.state_dict(), model(1))


def test_a_signed_store_accepts_unsigned_checkpoints_only_through_the_signed_chain(tmp_path):
    key = generate_keypair(tmp_path / "k")
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store=store, config=PublisherConfig(signing_key=str(key[0]), checkpoint_every=None))
    node = Subscriber(store=store, config=SubscriberConfig(trusted_keys=(str(key[1]),)))
    for s in range(6):
        pub.publish(model(s))
    assert node.sync() == 6
    w = node.write_checkpoint()  # an untrusted node's checkpoint: no signature at all
    assert w is not None and w.version == 6
    assert "signature" not in json.loads(unpack(store.get(w.key).data, where=w.key))
    pub.publish(model(6))
    joiner = Subscriber(store=store, config=SubscriberConfig(trusted_keys=(str(key[1]),)))
    assert joiner.sync() == 7 and joiner.stats.checkpoints_applied == 1
    assert_state_equal(joiner.state_dict(), model(6))
    # a checkpoint of weights the key never signed: refused, the joiner walks the signed chain
    other = LocalStore(tmp_path / "other")
    Publisher(store=other, config=PublisherConfig(checkpoint_every=None)).publish({k: v + 1 for k, v in model(5).items()})
    forged = json.loads(unpack(store.get(w.key).data, where=w.key))
    theirs = parse_manifest(manifest_bytes(other, 1))
    forged["tensors"] = [dict(t, digest=x.digest) for t, x in zip(forged["tensors"], theirs.tensors)]
    forged["model_digest"] = theirs.model_digest
    store.put(w.key, pack(json.dumps(forged, sort_keys=True, separators=(",", ":")).encode()))
    again = Subscriber(store=store, config=SubscriberConfig(trusted_keys=(str(key[1]),)))
    assert again.sync() == 7 and again.stats.checkpoints_refused == 1 and again.stats.checkpoints_applied == 0
    assert_state_equal(again.state_dict(), model(6))


def test_the_checkpoint_manifest_rules():
    from xcluster.format import parse_manifest as parse
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(d)
        publish(store, 3, checkpoint_every=1)
        ref = list_checkpoints(store)[0]
        good = json.loads(unpack(store.get(ref.key).data, where=ref.key))
        version = json.loads(manifest_bytes(store, ref.version))
    assert good["kind"] == "checkpoint" and good["checkpoint_of"]["version"] == ref.version
    assert all(t["init"] == "none" for t in good["tensors"])

    def refused(obj, match):
        with pytest.raises(FormatError, match=match):
            parse(json.dumps(obj).encode())
    refused({k: v for k, v in good.items() if k != "checkpoint_of"}, "checkpoint_of")
    refused(dict(good, checkpoint_of=dict(good["checkpoint_of"], version=ref.version - 1)), "checkpoint_of")
    refused(dict(good, prev_manifest=version["prev_manifest"]), "no prev_manifest")
    refused(dict(good, tensors=[dict(t, init="base") for t in good["tensors"]]), "init 'none'")
    refused(dict(version, checkpoint_of=good["checkpoint_of"]), "only a checkpoint")
    refused(dict(good, base_version=ref.version - 1), "no base")


def test_a_relay_starts_an_empty_destination_from_a_checkpoint_and_then_copies_deltas_only(tmp_path):
    src = LocalStore(tmp_path / "src")
    dst = LocalStore(tmp_path / "dst")
    pub = publish(src, 10, checkpoint_every=4)
    relay = Relay(src_store=src, dst_store=dst, config=RelayConfig(once=True, lease_every_s=0))
    assert relay.step() == 10
    assert relay.stats.checkpoints_copied == 1
    assert not dst.list(f"versions/{1:012d}/")  # the chain's start never crossed
    cp = read_checkpoint(src, list_checkpoints(src)[0]).manifest
    joiner = Subscriber(store=dst)
    assert joiner.sync() == 10 and joiner.stats.checkpoints_applied == 1
    crossed = relay.stats.bytes_from_source
    for s in range(10, 14):  # a checkpoint of 13 is written in SRC: it does not cross
        pub.publish(model(s))
        relay.step()
    assert relay.stats.checkpoints_copied == 1
    assert [c.version for c in list_checkpoints(src)][:1] == [13]
    assert [c.version for c in list_checkpoints(dst)] == [9]
    delta_bytes = version_chunk_bytes(src, range(11, 15))
    assert relay.stats.bytes_from_source - crossed < delta_bytes + 64 * 1024  # deltas and manifests only
    assert cp.chunk_bytes > 0
    # a subscriber in the cluster writes a fresh checkpoint from what it verified: no WAN bytes
    local = Subscriber(store=dst)
    assert local.sync() == 14
    local.write_checkpoint()
    assert [c.version for c in list_checkpoints(dst)] == [14, 9]
    late = Subscriber(store=dst)
    assert late.sync() == 14 and late.stats.checkpoints_applied == 1 and late.stats.versions_applied == 1
    assert_state_equal(late.state_dict(), model(13))
    report = gc(dst, config=RetentionConfig(grace_s=0, keep_checkpoints=1), now=lambda: FAR, apply=True)
    assert [c.version for c in list_checkpoints(dst)] == [14] and report.deleted


def test_a_relay_copies_a_checkpoint_when_the_destinations_is_too_far_behind(tmp_path):
    src = LocalStore(tmp_path / "src")
    dst = LocalStore(tmp_path / "dst")
    pub = publish(src, 2, checkpoint_every=3)
    relay = Relay(src_store=src, dst_store=dst, config=RelayConfig(once=True, lease_every_s=0, checkpoint_lag=5))
    relay.step()
    assert relay.stats.checkpoints_copied == 0  # none in SRC yet: DST starts from the keyframe
    for s in range(2, 9):
        pub.publish(model(s))
        relay.step()
    # HEAD 9, SRC checkpoints of 4 and 7: copied once DST's newest (none) was 5 behind
    assert relay.stats.checkpoints_copied >= 1
    assert list_checkpoints(dst)[0].version in (4, 7)
    assert Subscriber(store=dst).sync() == 9


def test_a_daemon_with_write_checkpoints_fills_its_local_store(tmp_path):
    from xcluster.follow.daemon import Daemon, DaemonConfig

    store = LocalStore(tmp_path / "s")
    pub = publish(store, 5, checkpoint_every=None)
    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0, warm_up=False,
                                                write_checkpoints_every=3))
    assert d.run() == 0
    assert [c.version for c in list_checkpoints(store)] == [5]
    for s in range(5, 7):  # 2 versions on: the newest checkpoint is recent enough
        pub.publish(model(s))
        assert d.step()
    assert [c.version for c in list_checkpoints(store)] == [5]
    pub.publish(model(7))
    assert d.step()
    assert [c.version for c in list_checkpoints(store)] == [8, 5]
    assert d.metrics.checkpoints_written._value.get() == 2
    joiner = Subscriber(store=store)
    assert joiner.sync() == 8 and joiner.stats.checkpoints_applied == 1
    assert_state_equal(joiner.state_dict(), model(7))

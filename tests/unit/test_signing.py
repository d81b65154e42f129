"""Signed versions: who may publish weights is who holds the key, not who can write the bucket."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.read.chain import read_head
from xcluster.cli import main
from xcluster.errors import (ConfigError, FormatError, RollbackError, RunMismatchError,
                             SignatureError, StaleHeadError)
from xcluster.follow.daemon import Daemon, DaemonConfig
from xcluster.format import HEAD_KEY, canonical_json, parse_head, parse_manifest
from xcluster.trust.signing import Signer, Verifier, generate_keypair
from xcluster.store import LocalStore
from xcluster.format.packing import pack, unpack
from tests.unit.helpers import assert_state_equal, make_weights, manifest_bytes


def weights(step: int) -> dict[str, torch.Tensor]:
    return {**make_weights(step, shapes={"w": (64, 32)}, changed=40, pick="randint", cumulative=False),
            "b": torch.full((8,), float(step), dtype=torch.bfloat16)}


@pytest.fixture
def keys(tmp_path):
    (tmp_path / "keys").mkdir()
    return {name: generate_keypair(tmp_path / "keys" / name) for name in ("a", "b")}


def signed_pub(store, key, **kw) -> Publisher:
    return Publisher(store=store, config=PublisherConfig(signing_key=str(key[0]), keyframe_every=3, **kw))


def trusting(store, *keys, **kw) -> Subscriber:
    return Subscriber(store=store, config=SubscriberConfig(trusted_keys=tuple(str(k[1]) for k in keys), **kw))


def assert_unchanged(sub: Subscriber, version: int, state: dict) -> None:
    snap = sub.snapshot()
    assert snap.version == version
    assert_state_equal(snap.state, state)


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path, capsys):
    assert main(["keygen", str(tmp_path / "trainer")]) == 0
    out = capsys.readouterr().out
    priv, pub = tmp_path / "trainer", tmp_path / "trainer.pub"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in priv.read_bytes() and b"PUBLIC KEY" in pub.read_bytes()
    assert Signer.from_file(priv).key_id in out
    assert list(Verifier.from_files([pub]).keys) == [Signer.from_file(priv).key_id]
    before = priv.read_bytes()
    assert main(["keygen", str(tmp_path / "trainer")]) == 2
    assert priv.read_bytes() == before


def test_signed_versions_are_accepted_and_verify_from_the_cli(tmp_path, keys, capsys):
    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"])
    for s in range(5):
        pub.publish(weights(s), step=s)
    head, _ = read_head(store)
    assert head.signature.key_id == keys["a"][2] and head.run_id == pub.run_id
    sub = trusting(store, keys["a"])
    assert sub.sync() == 5 and sub.manifest.signature.key_id == keys["a"][2]
    assert_state_equal(sub.state_dict(), weights(4))
    assert main(["verify", str(tmp_path / "s"), "--trust", str(keys["a"][1])]) == 0
    assert "signed by a trusted key" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "s"), "--trust", str(keys["b"][1])]) == 2
    assert "SignatureError" in capsys.readouterr().err


def test_an_unsigned_version_is_refused_and_the_last_good_weights_stay(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    signed_pub(store, keys["a"]).publish(weights(0))
    sub = trusting(store, keys["a"])
    assert sub.sync() == 1
    # someone with write access to the bucket (no key) publishes version 2
    Publisher(store=store).publish(weights(1))
    with pytest.raises(SignatureError, match="HEAD.*is not signed"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))
    # a fresh subscriber is refused as well, before it fetches anything
    with pytest.raises(SignatureError):
        trusting(store, keys["a"]).sync()


def test_a_version_signed_by_an_untrusted_key_is_refused(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"])
    pub.publish(weights(0))
    sub = trusting(store, keys["a"])
    sub.sync()
    signed_pub(store, keys["b"]).publish(weights(1))
    with pytest.raises(SignatureError, match=f"key {keys['b'][2]}, which is not trusted"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))


def test_a_rewritten_manifest_does_not_verify(tmp_path, keys):
    """The attacker rewrites a manifest (here: which file to load), re-hashes it into HEAD and
    keeps the signatures it has: HEAD's signature no longer covers HEAD; and a HEAD re-signed
    honestly over a tampered manifest still fails on the manifest's own signature."""
    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"])
    pub.publish(weights(0))
    sub = trusting(store, keys["a"])
    sub.sync()
    pub.publish(weights(1))
    head = parse_head(store.get(HEAD_KEY).data)
    m = parse_manifest(unpack(store.get(head.manifest_key).data, where="m"))
    tampered = m.to_obj()
    tampered["step"] = 999
    data = canonical_json(tampered)  # still carries the original signature
    store.put(head.manifest_key, pack(data))
    from xcluster.format import xxh3_128

    forged_head = head.to_obj()
    forged_head["manifest_xxh3_128"] = xxh3_128(data)
    store.put(HEAD_KEY, canonical_json(forged_head))
    with pytest.raises(SignatureError, match="HEAD.*does not verify"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))
    # even a HEAD the real key signs over the tampered manifest: the manifest itself fails
    store.put(HEAD_KEY, Signer.from_file(keys["a"][0]).sign(parse_head(canonical_json(forged_head))).to_bytes())
    with pytest.raises(SignatureError, match="manifest.*does not verify"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))


def test_key_rotation_trusts_several_keys(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    signed_pub(store, keys["a"]).publish(weights(0))
    sub = trusting(store, keys["a"], keys["b"])
    assert sub.sync() == 1
    pub_b = signed_pub(store, keys["b"])  # the trainer restarts with the new key: same run
    pub_b.publish(weights(1))
    pub_b.publish(weights(2))
    assert sub.sync() == 3
    assert_state_equal(sub.state_dict(), weights(2))
    assert trusting(store, keys["a"], keys["b"]).sync() == 3  # a new node walks a chain signed by both


def test_rollback_to_an_old_validly_signed_head_is_refused(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"], checkpoint_chain_fraction=None)
    pub.publish(weights(0))
    pub.publish(weights(1))
    old_head = store.get(HEAD_KEY).data  # version 2, validly signed
    pub.publish(weights(2))
    pub.publish(weights(3))
    sub = trusting(store, keys["a"])
    assert sub.sync() == 4
    store.put(HEAD_KEY, old_head)  # replay
    with pytest.raises(RollbackError, match="keeps serving version 4"):
        sub.sync()
    assert_unchanged(sub, 4, weights(3))


def test_a_fresh_subscriber_bounds_a_replayed_head_by_its_age(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    t = [1_800_000_000.0]
    pub = Publisher(store=store, config=PublisherConfig(signing_key=str(keys["a"][0])), clock=lambda: t[0])
    pub.publish(weights(0))
    pub.publish(weights(1))
    old_head = store.get(HEAD_KEY).data
    t[0] += 3600
    pub.publish(weights(2))
    store.put(HEAD_KEY, old_head)  # a stale replica, or an attacker, serves the hour-old HEAD
    cfg = dict(trusted_keys=(str(keys["a"][1]),), max_staleness_s=600)
    sub = Subscriber(store=store, config=SubscriberConfig(**cfg), clock=lambda: t[0] + 5)
    with pytest.raises(StaleHeadError, match="committed 3605 s ago.*holds no weights yet"):
        sub.sync()
    assert sub.version is None
    store.put(HEAD_KEY, Signer.from_file(keys["a"][0]).sign(parse_head(old_head)).to_bytes())
    # the attacker cannot make it fresh: re-dating HEAD breaks its signature
    forged = parse_head(old_head).to_obj()
    forged["committed_unix_ms"] = int((t[0] + 5) * 1000)
    store.put(HEAD_KEY, canonical_json(forged))
    with pytest.raises(SignatureError):
        sub.sync()
    assert sub.version is None


def test_another_runs_signed_versions_are_refused(tmp_path, keys):
    """Both runs are signed by the same key (one key per team is common): copying run B's
    objects over run A's prefix must not switch A's subscribers to B's weights."""
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    pub_a = signed_pub(a, keys["a"])
    pub_a.publish(weights(0))
    pub_b = signed_pub(b, keys["a"])
    assert pub_a.run_id != pub_b.run_id
    for s in range(4):
        pub_b.publish({"w": weights(s)["w"] * 2, "b": weights(s)["b"]})
    sub = trusting(a, keys["a"])
    assert sub.sync() == 1
    for k in b.list():
        a.put(k, b.get(k).data)  # B's versions 1-4 and HEAD over A's prefix
    with pytest.raises(RunMismatchError, match=f"run {pub_b.run_id!r}.*keeps serving version 1"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))
    pinned = Subscriber(store=a, config=SubscriberConfig(trusted_keys=(str(keys["a"][1]),), run_id=pub_a.run_id))
    with pytest.raises(RunMismatchError):
        pinned.sync()
    assert pinned.version is None


def test_the_publisher_continues_the_run_and_refuses_another(tmp_path):
    store = LocalStore(tmp_path / "s")
    first = Publisher(store=store, config=PublisherConfig(run_id="exp42"))
    first.publish(weights(0))
    assert Publisher(store=store).run_id == "exp42"  # a restarted trainer stays in its run
    with pytest.raises(ConfigError, match="holds run 'exp42'"):
        Publisher(store=store, config=PublisherConfig(run_id="exp43"))
    with pytest.raises(ConfigError, match="run id"):
        PublisherConfig(run_id="Bad/Id")


def test_keys_from_the_environment(tmp_path, keys, monkeypatch):
    store = LocalStore(tmp_path / "s")
    monkeypatch.setenv("XCLUSTER_SIGNING_KEY", keys["a"][0].read_text())
    Publisher(store=store).publish(weights(0))
    monkeypatch.delenv("XCLUSTER_SIGNING_KEY")
    monkeypatch.setenv("XCLUSTER_TRUSTED_KEYS", keys["b"][1].read_text() + keys["a"][1].read_text())
    sub = Subscriber(store=store)
    assert sub.verifier is not None and set(sub.verifier.keys) == {keys["a"][2], keys["b"][2]}
    assert sub.sync() == 1
    monkeypatch.setenv("XCLUSTER_TRUSTED_KEYS", keys["b"][1].read_text())
    with pytest.raises(SignatureError):
        Subscriber(store=store).sync()
    monkeypatch.delenv("XCLUSTER_TRUSTED_KEYS")
    monkeypatch.setenv("XCLUSTER_TRUSTED_KEY_FILES", os.pathsep.join([str(keys["b"][1]), str(keys["a"][1])]))
    assert Subscriber(store=store).sync() == 1


def test_a_private_key_is_not_a_trusted_key_and_bad_files_are_named(tmp_path, keys):
    with pytest.raises(ConfigError, match="not a PEM public key|no PEM public key"):
        Verifier.from_files([keys["a"][0]])
    (tmp_path / "junk").write_bytes(b"hello")
    with pytest.raises(ConfigError, match="no PEM public key"):
        Verifier.from_files([tmp_path / "junk"])
    with pytest.raises(ConfigError, match="not an unencrypted PEM private key"):
        Signer.from_file(tmp_path / "junk")
    with pytest.raises(ConfigError, match="cannot read key file"):
        Signer.from_file(tmp_path / "missing")


@pytest.mark.parametrize("sig, match", [
    ("nope", "must be an object"),
    ({"alg": "rsa", "key_id": "0" * 16, "value": "AA=="}, "'alg' is invalid"),
    ({"alg": "ed25519", "key_id": "XYZ", "value": "AA=="}, "'key_id' is invalid"),
    ({"alg": "ed25519", "key_id": "0" * 16, "value": "***"}, "not base64"),
    ({"alg": "ed25519", "key_id": "0" * 16, "value": "AAAA"}, "64 bytes, got 3"),
    ({"alg": "ed25519", "key_id": "0" * 16, "value": "A" * 88, "extra": 1}, "exactly alg, key_id and value"),
])
def test_malformed_signature_objects_are_format_errors(tmp_path, keys, sig, match):
    store = LocalStore(tmp_path / "s")
    signed_pub(store, keys["a"]).publish(weights(0))
    head = parse_head(store.get(HEAD_KEY).data).to_obj()
    head["signature"] = sig
    with pytest.raises(FormatError, match=match):
        parse_head(canonical_json(head))
    m = parse_manifest(manifest_bytes(store, 1)).to_obj()
    m["signature"] = sig
    with pytest.raises(FormatError, match=match):
        parse_manifest(canonical_json(m))


def test_a_restarted_daemon_that_cannot_restore_still_refuses_to_go_backwards(tmp_path, keys):
    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"], checkpoint_chain_fraction=None)
    pub.publish(weights(0))
    old_head = store.get(HEAD_KEY).data
    pub.publish(weights(1))
    pub.publish(weights(2))
    cfg = DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0, node_id="n1",
                       subscriber=SubscriberConfig(trusted_keys=(str(keys["a"][1]),)))
    assert Daemon(store=store, config=cfg).run() == 0
    # its saved weights are lost (e.g. /dev/shm after a reboot, without the state file going)
    shutil.rmtree(tmp_path / "out" / "slots")
    store.put(HEAD_KEY, old_head)
    d = Daemon(store=store, config=cfg)
    assert d.run() == 1
    assert d.subscriber.version is None  # it took nothing
    with pytest.raises(RollbackError, match="version 3 was already applied here"):
        d.subscriber.sync()


def test_unsigned_stores_still_work_without_trust(tmp_path):
    store = LocalStore(tmp_path / "s")
    pub = Publisher(store=store)
    pub.publish(weights(0))
    head, _ = read_head(store)
    assert head.signature is None and head.run_id == pub.run_id
    assert Subscriber(store=store).sync() == 1
    with pytest.raises(SignatureError, match="is not signed"):
        trusting(store, generate_keypair(tmp_path / "k")).sync()


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_in_head_is_a_format_error_for_every_reader(tmp_path, keys, constant):
    """Review 2, item 9: JSON's NaN/Infinity (which Python's json accepts) in a signed HEAD made the
    signed payload's re-encoding raise a bare ValueError in every daemon, relay and gc, no key
    needed. Now every reader refuses it as a FormatError and keeps serving."""
    from xcluster.fleet.relay import Relay, RelayConfig
    from xcluster.fleet.retention import RetentionConfig, gc

    store = LocalStore(tmp_path / "s")
    pub = signed_pub(store, keys["a"])
    pub.publish(weights(0))
    sub = trusting(store, keys["a"])
    assert sub.sync() == 1
    raw = store.get(HEAD_KEY).data
    store.put(HEAD_KEY, raw[:-1] + b',"x":' + constant.encode() + b"}")
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_head(store.get(HEAD_KEY).data)
    with pytest.raises(FormatError, match="not valid JSON"):
        sub.sync()
    assert_unchanged(sub, 1, weights(0))
    relay = Relay(src_store=store, dst_store=LocalStore(tmp_path / "d"),
                  config=RelayConfig(once=True, lease_every_s=0))
    with pytest.raises(FormatError, match="not valid JSON"):
        relay.step()
    with pytest.raises(FormatError, match="not valid JSON"):
        gc(store, config=RetentionConfig(grace_s=0), apply=True)

"""The relay on local stores: verbatim, in commit order, verified, resumable, chainable."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.cli import main
from xcluster.errors import (ChecksumMismatchError, ConcurrentPublisherError, ConfigError, ObjectNotFoundError,
                             ResourceLimitError,
                             RollbackError, RunMismatchError, SignatureError)
from xcluster.format import HEAD_KEY, lease_key, parse_head, parse_lease
from xcluster.fleet.relay import Relay, RelayConfig
from xcluster.trust.signing import generate_keypair
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights

ONCE = dict(once=True, lease_every_s=0)


def weights(step: int) -> dict[str, torch.Tensor]:
    return {**make_weights(step, shapes={"w": (256, 64)}, changed=300, pick="randint"), "step": torch.tensor([step])}


def publish(store, steps, **kw) -> Publisher:
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=3, checkpoint_chain_fraction=None, **kw),
                    files={"config.json": b'{"model_type": "llama"}'})
    for s in steps:
        pub.publish(weights(s), step=s)
    return pub


def relay(src, dst, **kw) -> Relay:
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**{**ONCE, **kw}))
    assert r.run() == 0, r.stats.last_error
    return r


def test_a_relay_copies_committed_versions_verbatim(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    publish(src, range(5))
    src.put("versions/000000000006/manifest-dead.json", b"an uncommitted leftover")
    r = relay(src, dst)
    assert dst.get(HEAD_KEY).data == src.get(HEAD_KEY).data
    # HEAD's chain back to its keyframe (4, 5), byte for byte; nothing uncommitted
    assert sorted(dst.list("versions/")) == sorted(k for k in src.list("versions/") if k.startswith(
        ("versions/000000000004/", "versions/000000000005/")))
    for k in dst.list():
        assert dst.get(k).data == src.get(k).data, k
    assert r.stats.versions_copied == 2
    sub = Subscriber(store=dst)
    assert sub.sync() == 5
    assert_state_equal(sub.state_dict(), weights(4))


def test_only_what_is_new_crosses_the_wan(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(3))
    relay(src, dst)
    for s in range(3, 5):
        pub.publish(weights(s), step=s)
    r = relay(src, dst)
    new = [k for k in src.list("versions/") if k.startswith(("versions/000000000004/", "versions/000000000005/"))]
    assert r.stats.versions_copied == 2
    # chunks and manifests of 4 (a keyframe: the walk back stops there) and 5, whose manifest is read
    # again to copy it (the walk holds one parsed manifest at a time): nothing else
    (m5,) = [k for k in new if k.startswith("versions/000000000005/manifest")]
    assert r.stats.bytes_from_source == sum(src.stat(k).size for k in new) + src.stat(m5).size
    assert r.stats.objects_present == 1  # config.json: unchanged since version 1
    pub.publish(weights(5), step=5)
    r = relay(src, dst)  # a delta on what DST holds: its link to its base is DST's HEAD, nothing else is read
    assert r.stats.bytes_from_source == sum(src.stat(k).size for k in src.list("versions/000000000006/"))
    assert Subscriber(store=dst).sync() == 6


def test_an_object_that_does_not_verify_is_never_written(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(2))
    relay(src, dst)
    pub.publish(weights(2), step=2)
    (key,) = [k for k in src.list("versions/000000000003/") if k.endswith(".xc")]
    data = bytearray(src.get(key).data)
    data[len(data) // 2] ^= 0x40
    src.put(key, bytes(data))
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE, integrity_retries=1))
    with pytest.raises(ChecksumMismatchError, match="not copied"):
        r.step()
    assert r.stats.refetches == 2
    assert parse_head(dst.get(HEAD_KEY).data).version == 2
    assert dst.list("versions/000000000003/") == []


@pytest.mark.parametrize("garbled_reads, raised", [(1, None), (2, "TruncatedObjectError")],
                         ids=["short once", "short every time"])
def test_an_object_read_short_in_transit_is_fetched_again_then_refused(tmp_path, garbled_reads, raised):
    from xcluster import errors

    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(2))
    relay(src, dst)
    pub.publish(weights(2), step=2)
    (key,) = [k for k in src.list("versions/000000000003/") if k.endswith(".xc")]
    left = [garbled_reads]

    class Short(LocalStore):
        def get_range(self, k, start, length):
            data = super().get_range(k, start, length)
            if k == key and left[0] > 0:
                left[0] -= 1
                return data[:-1]
            return data

    r = Relay(src_store=Short(tmp_path / "src"), dst_store=dst, config=RelayConfig(**ONCE, integrity_retries=1))
    if raised is None:
        assert r.step() == 3
        assert dst.get(key).data == src.get(key).data
    else:
        with pytest.raises(getattr(errors, raised), match="its manifest says .*: not copied"):
            r.step()
        assert parse_head(dst.get(HEAD_KEY).data).version == 2
    assert r.stats.refetches == garbled_reads  # every failed read counts, the last included


def test_a_source_rolled_back_is_not_propagated(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(2))
    old = src.get(HEAD_KEY).data
    pub.publish(weights(2), step=2)
    relay(src, dst)
    src.put(HEAD_KEY, old)
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE))
    with pytest.raises(RollbackError, match="does not propagate"):
        r.step()
    assert parse_head(dst.get(HEAD_KEY).data).version == 3


def test_a_relay_killed_before_head_resumes_without_fetching_again(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    publish(src, range(3))

    class DiesAtHead(LocalStore):
        def put(self, key, data, **kw):
            if key == HEAD_KEY:
                raise KeyboardInterrupt  # the process dies here
            return super().put(key, data, **kw)

    with pytest.raises(KeyboardInterrupt):
        Relay(src_store=src, dst_store=DiesAtHead(tmp_path / "dst"), config=RelayConfig(**ONCE)).step()
    with pytest.raises(ObjectNotFoundError):
        dst.get(HEAD_KEY)  # nothing visible to local subscribers
    r = relay(src, dst)
    assert r.stats.objects_copied == 0 and r.stats.objects_present == 4  # 3 chunks + config.json once
    assert Subscriber(store=dst).sync() == 3


def test_relays_chain_and_a_late_destination_jumps_to_the_keyframe(tmp_path):
    src, mid, leaf = (LocalStore(tmp_path / n) for n in ("src", "mid", "leaf"))
    pub = publish(src, range(2))
    relay(src, mid)
    relay(mid, leaf)
    for s in range(2, 8):  # keyframes at 1, 4, 7
        pub.publish(weights(s), step=s)
    relay(src, mid)
    r = relay(mid, leaf)
    assert r.stats.versions_copied == 2  # 7 and 8: what HEAD's chain needs
    sub = Subscriber(store=leaf)
    assert sub.sync() == 8
    assert_state_equal(sub.state_dict(), weights(7))


def test_signatures_travel_verbatim_and_a_trusting_relay_refuses_unsigned(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    priv, pub_key, _ = generate_keypair(tmp_path / "k")
    publish(src, range(2), signing_key=str(priv))
    relay(src, dst, trusted_keys=(str(pub_key),))
    trusting = Subscriber(store=dst, config=SubscriberConfig(trusted_keys=(str(pub_key),)))
    assert trusting.sync() == 2
    forged = Publisher(store=src)  # bucket write access, no key
    forged.publish(weights(9))
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE, trusted_keys=(str(pub_key),)))
    with pytest.raises(SignatureError):
        r.step()
    assert parse_head(dst.get(HEAD_KEY).data).version == 2


def test_a_second_writer_on_the_destination_is_detected(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(1))
    a = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE))
    b = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE))
    a.step()
    b.step()  # both agree on version 1
    pub.publish(weights(1))
    a.step()
    pub.publish(weights(2))
    with pytest.raises(ConcurrentPublisherError, match="one writer per destination"):
        b.step()  # b's view of DST's HEAD is stale: it moved under it


def test_the_relay_leases_what_it_copies_in_the_source(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    publish(src, range(2))
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(once=True, node_id="relay-eu1"))
    assert r.run() == 0
    lease = parse_lease(src.get(lease_key("relay-eu1")).data)
    assert lease.version == 2 and lease.head_version == 2 and lease.target_version is None


def test_cli_relay_once_and_torch_free(tmp_path, capsys):
    src = LocalStore(tmp_path / "src")
    publish(src, range(2))
    assert main(["relay", str(tmp_path / "src"), str(tmp_path / "dst"), "--once", "--lease-interval", "0"]) == 0
    assert "relay stopped at version 2" in capsys.readouterr().err
    assert Subscriber(str(tmp_path / "dst")).sync() == 2
    code = ("import sys, xcluster.fleet.relay, xcluster.cli; "
            "xcluster.cli.main(['relay', sys.argv[1], sys.argv[2], '--once', '--lease-interval', '0']); "
            "assert 'torch' not in sys.modules, 'the relay imported torch'")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "dst2")], check=True,
                   capture_output=True)
    assert LocalStore(tmp_path / "dst2").get(HEAD_KEY).data == src.get(HEAD_KEY).data


def test_a_replayed_signed_version_of_another_run_is_refused_before_anything_is_copied(tmp_path):
    src, dst, other = (LocalStore(tmp_path / n) for n in ("src", "dst", "other"))
    priv, pub_key, _ = generate_keypair(tmp_path / "k")
    trust = dict(trusted_keys=(str(pub_key),))
    publish(src, range(2), signing_key=str(priv), run_id="runa")
    relay(src, dst, **trust)
    good_head = src.get(HEAD_KEY).data
    # another run signed by the same key, replayed into SRC with higher version numbers
    publish(other, range(6), signing_key=str(priv), run_id="runb")
    replayed = [k for k in other.list("versions/") if not k.startswith(("versions/000000000001/",
                                                                        "versions/000000000002/"))]
    for k in replayed:
        src.put(k, other.get(k).data)
    src.put(HEAD_KEY, other.get(HEAD_KEY).data)
    for cfg in (trust, {}):  # DST holds run "runa": that pins it, with signatures or without
        r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE, **cfg))
        with pytest.raises(RunMismatchError, match="runb"):
            r.step()
        assert dst.get(HEAD_KEY).data == good_head
        assert all(not k.startswith(("versions/000000000004/", "versions/000000000005/", "versions/000000000006/"))
                   for k in dst.list("versions/")), "nothing of the other run is copied"
    # the relay is not frozen: once SRC names run "runa" again, it follows
    src.put(HEAD_KEY, good_head)
    assert r.step() == 2
    # an explicit pin refuses even on an empty destination
    pinned = Relay(src_store=src, dst_store=LocalStore(tmp_path / "dst2"), config=RelayConfig(**ONCE, run_id="runb"))
    with pytest.raises(RunMismatchError, match="given run 'runb'"):
        pinned.step()
    assert LocalStore(tmp_path / "dst2").list() == []
    with pytest.raises(ConfigError):
        RelayConfig(run_id="Not A Run")


def test_the_first_version_copied_pins_the_run(tmp_path):
    src, dst, other = (LocalStore(tmp_path / n) for n in ("src", "dst", "other"))
    publish(src, range(1), run_id="runa")
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE))
    assert r.step() == 1
    publish(other, range(4), run_id="runb")  # keyframes 1 and 4
    for k in other.list("versions/000000000004/") + [HEAD_KEY]:
        src.put(k, other.get(k).data)
    with pytest.raises(RunMismatchError, match="runb"):
        r.step()
    assert dst.list("versions/000000000004/") == [] and parse_head(dst.get(HEAD_KEY).data).version == 1


def test_a_chain_over_the_byte_budget_is_refused_before_anything_is_copied(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    publish(src, range(3))  # keyframe 1, deltas 2 and 3: the walk reads 3 manifests
    r = Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE, max_plan_bytes=1000))
    with pytest.raises(ResourceLimitError, match="max_plan_bytes"):
        r.step()
    assert dst.list() == []
    with pytest.raises(ResourceLimitError):  # remembered: refused again without reading the chain
        r.step()
    assert Relay(src_store=src, dst_store=dst, config=RelayConfig(**ONCE)).step() == 3
    with pytest.raises(ConfigError):
        RelayConfig(max_plan_bytes=0)


def test_a_corrupt_copy_of_the_right_size_in_the_destination_is_copied_again(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    pub = publish(src, range(2))
    relay(src, dst)
    # a relay killed before HEAD left version 3's chunk behind; it and files/config.json rot in DST
    pub.publish(weights(2), step=2)
    (chunk,) = [k for k in src.list("versions/000000000003/") if k.endswith(".xc")]
    (cfg,) = [k for k in src.list("files/")]
    for k in (chunk, cfg):
        data = bytearray(src.get(k).data)
        data[len(data) // 2] ^= 0x01
        dst.put(k, bytes(data))
    r = relay(src, dst)
    for k in (chunk, cfg):
        assert dst.get(k).data == src.get(k).data, k
    assert r.stats.objects_copied == 2
    sub = Subscriber(store=dst)
    assert sub.sync() == 3

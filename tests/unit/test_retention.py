"""Retention (gc) and fleet status on real stores built by the real Publisher."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.format import Lease, file_key, lease_key
from xcluster.fleet.retention import RetentionConfig, gc
from xcluster.fleet.status import fleet_status
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, make_weights
from tests.unit.test_commit_protocol import weights

FAR = 4e9  # "now" far in the future (2096): every object is past its grace


def publish(store, n, keyframe_every=3):
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=keyframe_every, checkpoint_chain_fraction=None),
                    files={"config.json": b"{}"})
    return pub, [pub.publish(weights(s)) for s in range(n)]


def lease(store, node, *, version, target=None, age_s=0.0, now=FAR):
    store.put(lease_key(node), Lease(node_id=node, version=version, target_version=target, model_digest=None,
                                     updated_unix_ms=int((now - age_s) * 1000)).to_bytes())


def test_dry_run_deletes_nothing_and_apply_keeps_what_head_needs(tmp_path):
    store = LocalStore(tmp_path)
    pub, res = publish(store, 8)  # keyframes 1, 4, 7; HEAD 8
    before = sorted(store.list())
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR)
    assert sorted(store.list()) == before and not report.applied
    gone = {k for k, _, _ in report.deleted}
    assert gone and all(k.startswith(("versions/000000000001/", "versions/000000000002/",
                                      "versions/000000000003/", "versions/000000000004/",
                                      "versions/000000000005/", "versions/000000000006/")) for k in gone)
    assert report.bytes == sum(store.stat(k).size for k in gone)
    gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    sub = Subscriber(store=store)
    assert sub.sync() == 8 and sub.model_digest == res[-1].model_digest
    assert store.list("files/")  # still named by the kept manifests


def test_young_objects_are_kept_whatever_is_asked(tmp_path):
    store = LocalStore(tmp_path)
    publish(store, 8)
    report = gc(store, config=RetentionConfig(grace_s=3600), now=time.time, apply=True)
    assert report.deleted == []


def test_a_live_subscriber_mid_fetch_keeps_its_chain_until_its_lease_expires(tmp_path):
    store = LocalStore(tmp_path)
    pub, res = publish(store, 5)  # keyframes 1, 4; a subscriber holds 2 and fetches 3 (HEAD was 3)
    for s in range(5, 8):
        pub.publish(weights(s))  # HEAD 8, keyframe 7
    lease(store, "slow", version=2, target=3)
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert report.protected_by_leases == {"slow": (3, 3)}
    assert store.list("versions/000000000003/")
    # the slow subscriber can still reach its target from what it holds
    late = Subscriber(store=store)
    assert late.sync(until=8) == 8
    # once its lease expires, the next gc removes it
    lease(store, "slow", version=2, target=3, age_s=10_000)
    gc(store, config=RetentionConfig(grace_s=0, lease_ttl_s=300), now=lambda: FAR, apply=True)
    assert store.list("versions/000000000003/") == []


def test_files_a_leased_version_names_are_kept_with_it(tmp_path):
    store = LocalStore(tmp_path)
    pub, _ = publish(store, 5)  # every manifest so far names config.json = b"{}"
    slow = Subscriber(store=store)
    assert slow.sync(until=2) == 2
    for s in range(5, 8):
        pub.publish(weights(s), files={"config.json": b'{"v": 2}'})  # HEAD's chain names only the new one
    lease(store, "slow", version=2, target=3)
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert report.protected_by_leases == {"slow": (3, 3)}
    assert len(store.list("files/")) == 2, "the leased target still names the old config.json"
    assert slow.sync(until=3) == 3
    (entry,) = slow.manifest.files
    assert store.get(file_key(entry.xxh3_128)).data == b"{}"
    lease(store, "slow", version=3, target=None, age_s=10_000)
    gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert len(store.list("files/")) == 1


def test_apply_deletes_manifests_before_their_chunks(tmp_path):
    deleted = []

    class Recording(LocalStore):
        def delete(self, key):
            deleted.append(key)
            super().delete(key)

    store = Recording(tmp_path)
    publish(store, 8)
    deleted.clear()  # the publisher's own (its in-flight markers)
    gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    kinds = ["manifest" in k.rsplit("/", 1)[-1] for k in deleted]
    assert True in kinds and False in kinds
    assert kinds == sorted(kinds, reverse=True), "a manifest was deleted after a chunk"


def test_unreferenced_attempts_and_files_go_after_grace(tmp_path):
    store = LocalStore(tmp_path)
    pub, _ = publish(store, 2)
    store.put("versions/000000000002/manifest-dead.json", b"{}")
    store.put("versions/000000000002/cdead-000000.xc", b"x")
    store.put("versions/000000000009/manifest-zzz.json", b"{}")
    store.put("files/" + "0" * 32, b"old tokenizer")
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    gone = {k for k, _, _ in report.deleted}
    assert {"versions/000000000002/manifest-dead.json", "versions/000000000002/cdead-000000.xc",
            "versions/000000000009/manifest-zzz.json", "files/" + "0" * 32} <= gone
    assert Subscriber(store=store).sync() == 2


def test_a_store_written_before_1_0_is_refused_and_nothing_deleted(tmp_path):
    from xcluster.errors import LegacyFormatError
    from tests.unit.test_golden import OLD_HEAD

    store = LocalStore(tmp_path)
    publish(store, 3)
    keys = sorted(store.list())
    store.put("HEAD", OLD_HEAD)
    with pytest.raises(LegacyFormatError, match="xcluster<1"):
        gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert sorted(store.list()) == keys


def test_fleet_status_and_cli(tmp_path):
    store = LocalStore(tmp_path)
    publish(store, 4)
    now = time.time()
    store.put(lease_key("a"), Lease(node_id="a", version=4, target_version=None, model_digest=None,
                                    updated_unix_ms=int(now * 1000), engine_state="ok", engine_version=4,
                                    committed_unix_ms=int((now - 2) * 1000)).to_bytes())
    store.put(lease_key("b"), Lease(node_id="b", version=1, target_version=None, model_digest=None,
                                    updated_unix_ms=int((now - 4000) * 1000), engine_state="failing",
                                    last_error="HandoffError: 503").to_bytes())
    fs = fleet_status(store, now=lambda: now)
    by = {s.lease.node_id: s for s in fs.subscribers}
    assert by["a"].behind == 0 and by["a"].live and 1.5 < by["a"].staleness_s < 2.5
    assert by["b"].behind == 3 and not by["b"].live
    env = dict(os.environ, PYTHONPATH=str(tmp_path.parent))
    out = subprocess.run([sys.executable, "-m", "xcluster.cli", "status", str(tmp_path), "--fail-if-behind", "0"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr  # b is behind but expired: not alerted
    assert "HandoffError: 503" in out.stdout and "EXPIRED" in out.stdout
    gc_out = subprocess.run([sys.executable, "-m", "xcluster.cli", "gc", str(tmp_path), "--grace", "0"],
                            capture_output=True, text=True)
    assert gc_out.returncode == 0 and "dry run" in gc_out.stdout
    # neither command imports torch
    probe = subprocess.run([sys.executable, "-c", "import sys, xcluster.cli as c; c.main(['status', sys.argv[1]]); "
                            "assert 'torch' not in sys.modules, 'torch imported'", str(tmp_path)],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert model_digest  # imported for symmetry with other tests


def test_the_publisher_runs_retention_after_each_checkpoint_and_joiners_start_from_it(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store=store, clock=lambda: FAR,
                    config=PublisherConfig(checkpoint_every=3, checkpoint_chain_fraction=None,
                                           gc_after_checkpoint=RetentionConfig(grace_s=0, keep_checkpoints=1)))
    follower = Subscriber(store=store)
    for s in range(7):  # keyframe 1, then deltas; checkpoints of 4 and 7
        pub.publish(weights(s))
        follower.sync()
    assert sorted({k.split("/")[1] for k in store.list("versions/")}) == ["000000000007"]
    assert sorted({k.split("/")[1] for k in store.list("checkpoints/")}) == ["000000000007"]
    joiner = Subscriber(store=store)
    assert joiner.sync() == 7 and joiner.stats.checkpoints_applied == 1
    pub.publish(weights(7))
    assert follower.sync() == joiner.sync() == 8
    assert follower.model_digest == joiner.model_digest
    assert follower.stats.checkpoints_applied == 0 and joiner.stats.versions_applied == 2


def test_a_lease_dated_in_the_future_protects_nothing(tmp_path):
    """Review 2, item 5: a lease dated far ahead of gc's clock (a skewed node, or a forged lease)
    pinned its versions forever. Beyond RetentionConfig.max_clock_skew_s it protects nothing."""
    store = LocalStore(tmp_path)
    pub, _ = publish(store, 5)
    for s in range(5, 8):
        pub.publish(weights(s))  # HEAD 8, keyframe 7
    lease(store, "skewed", version=2, target=3, age_s=-120)  # 2 minutes ahead: a skew, still honoured
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=False)
    assert report.protected_by_leases == {"skewed": (3, 3)}
    lease(store, "forged", version=2, target=3, age_s=-10 * 365 * 86400)  # ten years ahead
    lease(store, "skewed", version=2, target=3, age_s=10_000)  # and the honest one expired
    report = gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert report.protected_by_leases == {}
    assert report.future_leases == ["forged"]
    assert store.list("versions/000000000003/") == []
    assert Subscriber(store=store).sync() == 8


def test_leases_are_read_in_bounded_bytes(tmp_path):
    """Review 2, item 8: gc and status read a lease whole before its 64 KiB check (256 MiB lease,
    256 MiB read). Now at most MAX_LEASE_BYTES + 1 bytes of it are read."""
    from xcluster.format import MAX_LEASE_BYTES

    read: dict[str, int] = {}

    class Counting(LocalStore):
        def get(self, key, **kw):
            blob = super().get(key, **kw)
            if key.startswith("leases/") and blob is not None:
                read[key] = read.get(key, 0) + len(blob.data)
            return blob

        def get_range(self, key, start, length):
            data = super().get_range(key, start, length)
            if key.startswith("leases/"):
                read[key] = read.get(key, 0) + len(data)
            return data

    store = Counting(tmp_path)
    publish(store, 2)
    store.put(lease_key("huge"), b"{" + b" " * (4 << 20) + b"}")
    gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR)
    assert 0 < read["leases/huge.json"] <= MAX_LEASE_BYTES + 1
    read.clear()
    fs = fleet_status(store, now=lambda: FAR)
    assert fs.unreadable == ["leases/huge.json"]
    assert 0 < read["leases/huge.json"] <= MAX_LEASE_BYTES + 1


def test_a_file_gc_removed_is_uploaded_again_when_a_later_version_names_it(tmp_path):
    """Review 2, item 6: the publisher remembered which files/ objects it had uploaded and never
    looked again, so files A -> B -> A after gc had removed A committed a version naming a missing
    object. A file the previous version did not name is uploaded afresh (a new age for the grace)."""
    from xcluster.format import xxh3_128

    store = LocalStore(tmp_path)
    a, b = {"config.json": b'{"a": 1}'}, {"config.json": b'{"b": 2}'}
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100), files=a)
    pub.publish(weights(0))
    pub.publish(weights(1), files=b, keyframe=True)  # version 1, the last to name A, falls behind the keyframe
    gc(store, config=RetentionConfig(grace_s=0), now=lambda: FAR, apply=True)
    assert store.list("files/") == [file_key(xxh3_128(b["config.json"]))]  # A is no longer named: gone
    pub.publish(weights(2), files=a)
    assert store.get(file_key(xxh3_128(a["config.json"]))).data == a["config.json"]
    from xcluster.follow.daemon import Daemon, DaemonConfig
    from xcluster.follow.slots import Slots

    d = Daemon(store=store, config=DaemonConfig(out=tmp_path / "out", once=True, lease_every_s=0))
    assert d.run() == 0
    s = Slots(tmp_path / "out")
    assert s.files(s.current()) == a


def _bigger(step: int) -> dict[str, torch.Tensor]:
    return make_weights(seed=step, shapes={"w": (256, 256), "b": (64,)}, dtype=torch.float32)  # several 64 KiB chunks  # several 64 KiB chunks


def test_gc_keeps_an_upload_that_outlives_the_grace_period(tmp_path):
    """Review 2, item 7: a version whose upload takes longer than gc's grace period (a multi-TiB
    keyframe) lost its first chunks to a gc running meanwhile, and the publisher then committed a
    version nobody can apply. The in-flight marker, rewritten while the upload goes on, keeps the
    attempt's objects, however old each one is."""
    import os
    import time as _time

    class SlowUpload(LocalStore):
        """Each chunk lands "two hours ago" (as in a long upload), and gc runs after each one."""

        def put(self, key, data, **kw):
            etag = super().put(key, data, **kw)
            if key.endswith(".xc"):
                old = _time.time() - 7200
                os.utime(self._path(key), (old, old))
                gc(self, config=RetentionConfig(grace_s=3600), apply=True)
            return etag

    cfg = PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=64 << 10, chunk_bytes=64 << 10))
    Publisher(store=LocalStore(tmp_path), config=cfg).publish(_bigger(0))  # HEAD exists: gc has work
    store = SlowUpload(tmp_path)
    res = Publisher(store=store, config=cfg).publish(_bigger(1))  # a new publisher: a keyframe, 4+ chunks
    assert len([k for k in store.list(f"versions/{res.version:012d}/") if k.endswith(".xc")]) >= 3
    sub = Subscriber(store=store)
    assert sub.sync() == res.version == 2
    assert_state_equal(sub.state_dict(), _bigger(1))
    assert store.list("inflight/") == []  # removed once committed


def test_chunks_gone_before_the_commit_are_refused_not_committed(tmp_path):
    """Review 2, item 7: chunks removed while the version was uploaded (retention with a skewed
    clock, an operator) make the publish fail with ChunksMissingError; HEAD does not move."""
    from xcluster.errors import ChunksMissingError

    store = LocalStore(tmp_path)
    cfg = PublisherConfig(keyframe_every=100, codec=CodecConfig(block_bytes=64 << 10, chunk_bytes=64 << 10))
    pub = Publisher(store=store, config=cfg)
    pub.publish(_bigger(0))

    class Vanishing(LocalStore):
        def put(self, key, data, **kw):
            etag = super().put(key, data, **kw)
            if key.endswith("-000000.xc"):
                super().delete(key)  # the first chunk of the attempt disappears at once
            return etag

    with pytest.raises(ChunksMissingError, match="are gone"):
        Publisher(store=Vanishing(tmp_path), config=cfg).publish(_bigger(1))
    sub = Subscriber(store=store)
    assert sub.sync() == 1
    assert_state_equal(sub.state_dict(), _bigger(0))

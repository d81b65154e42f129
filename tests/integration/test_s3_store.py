"""S3Store against real servers (SeaweedFS and moto): conformance, multipart, conditional writes,
retries through a fault-injecting proxy, and what the AWS CLI sees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.store_conformance import StoreConformance
from tests.support.faultproxy import KINDS, FaultProxy
from xcluster.errors import (ConditionalWritesUnsupportedError, ObjectNotFoundError,
                             PreconditionFailedError, RetriesExhaustedError, StoreError)
from xcluster.util.retry import RetryPolicy
from xcluster.store.s3.config import MiB

pytestmark = pytest.mark.integration

NO_WAIT = RetryPolicy(attempts=12, deadline_s=60, initial_backoff_s=0.0, max_backoff_s=0.0,
                      jitter_s=0.0)


def _uploads(server, store) -> list[dict]:
    listing = server.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store._prefix)
    return listing.get("Uploads", [])


class TestS3Conformance(StoreConformance):
    @pytest.fixture
    def store(self, s3_server):
        return s3_server.store()


# --- multipart and ranged download ---------------------------------------------------------------
def test_multipart_upload_and_ranged_download_run_parts_in_parallel(s3_server):
    store = s3_server.store()
    data = os.urandom(4 * 5 * MiB + 12345)  # 5 parts of 5 MiB
    etag = store.put("versions/000000000001/keyframe.xc", data)
    assert etag.strip('"').endswith("-5"), etag  # the server saw a 5-part multipart upload
    assert store.stats.multipart_uploads == 1 and store.stats.parts_uploaded == 5
    assert store.stats.max_parts_in_flight > 1, "parts were not uploaded concurrently"
    store.stats.max_parts_in_flight = 0
    blob = store.get("versions/000000000001/keyframe.xc")
    assert bytes(blob.data) == data and blob.etag == etag
    assert store.stats.parts_downloaded == 5
    assert store.stats.max_parts_in_flight > 1, "parts were not downloaded concurrently"
    # a large get_range goes parallel too; a small one is one ranged GET
    assert store.get_range("versions/000000000001/keyframe.xc", 7, 11 * MiB) == data[7:7 + 11 * MiB]
    assert store.get_range("versions/000000000001/keyframe.xc", len(data) - 5, 100) == data[-5:]
    assert _uploads(s3_server, store) == []


def test_a_large_object_is_never_held_twice(seaweedfs):
    """Python-allocated memory (tracemalloc) beyond the object itself, on a multipart upload from
    a memoryview (two parts in flight: copied, they would take 10 MiB) and on a ranged download of it."""
    import tracemalloc

    store = seaweedfs.store(max_concurrency=2)
    buf = bytearray(os.urandom(6 * 5 * MiB + 999))  # 7 parts of 5 MiB
    key = "versions/000000000001/big.xc"
    tracemalloc.start()
    try:
        store.put(key, memoryview(buf))
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        got = store.get_range(key, 0, len(buf) + 1)
        _, get_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == buf and store.stats.parts_uploaded == 7 and store.stats.parts_downloaded >= 5
    assert put_peak < 8 * MiB, f"upload held {put_peak / MiB:.1f} MiB beyond the object"
    assert get_peak < len(buf) + 4 * MiB, f"download peaked at {get_peak / MiB:.1f} MiB for {len(buf) / MiB:.1f}"


def test_download_refuses_objects_above_max_object_size(s3_server):
    store = s3_server.store()
    store.put("big", b"x" * (6 * MiB))
    small = s3_server.store(max_object_size=6 * MiB - 1)
    small._prefix, small.url = store._prefix, store.url
    from xcluster.errors import ObjectTooLargeError

    with pytest.raises(ObjectTooLargeError, match="max_object_size"):
        small.get("big")


def test_failed_multipart_upload_is_aborted(s3_server):
    """A part that keeps failing ends the upload, and the upload is aborted: no orphaned parts."""
    def part_3_fails(index, method, path):
        return "error500" if method == "PUT" and "partNumber=3" in path else None

    with FaultProxy(s3_server.address, schedule=part_3_fails) as proxy:
        store = s3_server.store(endpoint=proxy.endpoint, sleep=lambda s: None,
                                retry=RetryPolicy(attempts=3, initial_backoff_s=0, jitter_s=0))
        with pytest.raises(RetriesExhaustedError, match="part 3"):
            store.put("k", os.urandom(4 * 5 * MiB))
        assert proxy.counts["error500"] == 3
        with pytest.raises(ObjectNotFoundError):
            store.stat("k")
    assert store.stats.aborted_uploads == 1
    assert _uploads(s3_server, store) == []


def test_lost_create_once_of_multipart_is_aborted(s3_server):
    store = s3_server.store()
    store.put("m", os.urandom(6 * MiB), if_none_match=True)
    with pytest.raises(PreconditionFailedError):
        store.put("m", os.urandom(6 * MiB), if_none_match=True)
    assert _uploads(s3_server, store) == []  # servers keep the upload after a 412; we abort it


# --- conditional writes --------------------------------------------------------------------------
#: What each server enforces (found by these tests; see docs/S3.md).
HONOURS = {
    "seaweedfs": {"If-None-Match", "If-Match", "multipart If-None-Match", "multipart If-Match"},
    "moto": {"If-None-Match", "If-Match", "multipart If-None-Match"},
}
FEATURES = ["If-None-Match", "If-Match", "multipart If-None-Match", "multipart If-Match"]


@pytest.mark.parametrize("feature", FEATURES)
def test_which_conditional_writes_the_server_enforces(s3_server, feature):
    honoured = s3_server.store()._probe(feature)
    print(f"\n[{s3_server.name}] {feature} on writes enforced: {honoured}")
    assert honoured == (feature in HONOURS[s3_server.name])


def test_conditional_writes_are_enforced_by_the_server(s3_server):
    """The server's own enforcement (no HEAD-then-PUT: that only runs for unsupported ones)."""
    store = s3_server.store()
    client = s3_server.client()
    key = store._prefix + "HEAD"
    client.put_object(Bucket=store.bucket, Key=key, Body=b"rival")  # behind the store's back
    with pytest.raises(PreconditionFailedError):
        store.put("HEAD", b"mine", if_none_match=True)
    rival = client.head_object(Bucket=store.bucket, Key=key)["ETag"]
    with pytest.raises(PreconditionFailedError):
        store.put("HEAD", b"mine", if_match='"0123456789abcdef0123456789abcdef"')
    with pytest.raises(PreconditionFailedError):  # if-match on a missing key
        store.put("nothing-here", b"x", if_match=rival)
    big = os.urandom(6 * MiB)
    with pytest.raises(PreconditionFailedError):  # multipart create-once
        store.put("HEAD", big, if_none_match=True)
    if "multipart If-Match" in HONOURS[s3_server.name]:
        e2 = store.put("HEAD", big, if_match=rival)  # multipart compare-and-swap
        with pytest.raises(PreconditionFailedError):
            store.put("HEAD", big, if_match=rival)
        assert bytes(store.get("HEAD").data) == big and store.stat("HEAD").etag == e2
    else:  # moto: refused up front rather than silently unsafe
        with pytest.raises(ConditionalWritesUnsupportedError, match="multipart If-Match"):
            store.put("HEAD", big, if_match=rival)
        assert store.get("HEAD").data == b"rival"
    assert _uploads(s3_server, store) == []


def test_probe_finds_conditional_writes_supported(s3_server):
    store = s3_server.store()
    store.put("a", b"1", if_none_match=True)
    assert store._honoured == {"If-None-Match": True}
    assert store.list() == ["a"]  # the probe cleaned up after itself


def test_server_ignoring_conditional_writes_is_refused_or_emulated(moto_s3):
    """A server that ignores the headers (imitated by a proxy that drops them; moto does not
    check signatures) is refused by default, and with the flag off, HEAD-then-PUT is used."""
    with FaultProxy(moto_s3.address, strip_request_headers=("If-None-Match", "If-Match")) as proxy:
        strict = moto_s3.store(endpoint=proxy.endpoint)
        strict.put("HEAD", b"unconditional writes still work")
        with pytest.raises(ConditionalWritesUnsupportedError, match="require_conditional_writes"):
            strict.put("HEAD", b"x", if_none_match=True)

        lax = moto_s3.store(endpoint=proxy.endpoint, require_conditional_writes=False)
        with pytest.warns(RuntimeWarning, match="does NOT close the race"):
            e1 = lax.put("HEAD", b"v1", if_none_match=True)
        with pytest.raises(PreconditionFailedError, match="HEAD-then-PUT"):
            lax.put("HEAD", b"v2", if_none_match=True)
        with pytest.raises(PreconditionFailedError, match="HEAD-then-PUT"):
            lax.put("HEAD", b"v2", if_match='"stale"')
        lax.put("HEAD", b"v2", if_match=e1)
        assert lax.get("HEAD").data == b"v2"


def test_lost_response_of_create_once_is_our_own_write(s3_server):
    """The server applies the PUT but the response is lost: the retry gets a 412, and the
    store recognises its own write (by the write id in its metadata) instead of failing."""
    seen = []

    def first_commit_reset(index, method, path):
        if method == "PUT" and "/commit" in path and not seen:
            seen.append(path)
            return "reset"
        return None

    with FaultProxy(s3_server.address, schedule=first_commit_reset) as proxy:
        store = s3_server.store(endpoint=proxy.endpoint, retry=NO_WAIT)
        etag = store.put("commit", b"version 7", if_none_match=True)
        assert proxy.counts["reset"] == 1 and store.stats.retries >= 1
        assert store.stat("commit").etag == etag
        with pytest.raises(PreconditionFailedError):  # a real rival still loses
            store.put("commit", b"version 7 again", if_none_match=True)


# --- retry policy --------------------------------------------------------------------------------
def test_backoff_is_exponential_and_injected(seaweedfs):
    waits: list[float] = []

    def first_three(index, method, path):
        return "slowdown" if index < 3 else None

    with FaultProxy(seaweedfs.address, schedule=first_three) as proxy:
        store = seaweedfs.store(endpoint=proxy.endpoint, sleep=waits.append, probe_conditional_writes=False,
                                retry=RetryPolicy(attempts=5, initial_backoff_s=0.5,
                                                  max_backoff_s=10, jitter_s=0.0))
        store.put("k", b"v")
    assert waits == [0.5, 1.0, 2.0]
    assert store.stats.retries == 3 and proxy.counts["slowdown"] == 3


def test_permanent_errors_are_not_retried(seaweedfs):
    store = seaweedfs.store(sleep=lambda s: pytest.fail("slept: a permanent error was retried"))
    with pytest.raises(ObjectNotFoundError):
        store.get("missing")
    store.put("k", b"v", if_none_match=True)
    before = store.stats.requests
    with pytest.raises(PreconditionFailedError):
        store.put("k", b"w", if_none_match=True)
    assert store.stats.requests == before + 1 and store.stats.retries == 0
    bad = seaweedfs.store(profile="xc-bad", sleep=lambda s: pytest.fail("retried a 403"))
    with pytest.raises(StoreError, match="403"):
        bad.get("k")
    assert bad.stats.requests == 1


def test_retries_exhausted_names_object_and_cause(seaweedfs):
    with FaultProxy(seaweedfs.address, probability=1.0, kinds=("error500",)) as proxy:
        store = seaweedfs.store(endpoint=proxy.endpoint, sleep=lambda s: None,
                                retry=RetryPolicy(attempts=4, initial_backoff_s=0, jitter_s=0))
        with pytest.raises(RetriesExhaustedError, match=r"/k: get: still failing after 4") as err:
            store.get("k")
    assert "InternalError" in repr(err.value.__cause__)
    assert proxy.counts["error500"] == 4


@pytest.mark.parametrize("kind", KINDS)
def test_every_fault_kind_is_survived_with_exact_bytes(s3_server, kind):
    small, big = os.urandom(300_000), os.urandom(3 * 5 * MiB + 999)
    # flips only in GET bodies: those are the data; a flipped XML answer is not what we test
    with FaultProxy(s3_server.address, probability=0.35, kinds=(kind,), seed=7,
                    fault_latency_s=0.05, methods=("GET",) if kind == "flip" else None) as proxy:
        store = s3_server.store(endpoint=proxy.endpoint, retry=NO_WAIT, read_timeout_s=10)
        store.put("small", small, if_none_match=True)
        store.put("big", big)
        for _ in range(2):
            assert bytes(store.get("small").data) == small
            assert bytes(store.get("big").data) == big
            assert store.get_range("small", 0, 10**6) == small  # whole object: hash-checked
        if kind != "flip":  # a partial block is not hash-checked (see docs/S3.md)
            assert store.get_range("big", 5 * MiB - 3, 1000) == big[5 * MiB - 3:5 * MiB + 997]
        assert store.list() == ["big", "small"]
    print(f"\n[{s3_server.name}] injected {dict(proxy.counts)} in {proxy.requests} requests; "
          f"store retried {store.stats.retries}, corrupt reads caught {store.stats.corrupt_reads}")
    assert proxy.counts[kind] > 0
    if kind == "flip":
        assert store.stats.corrupt_reads > 0
    assert _uploads(s3_server, store) == []


# --- what a user sees with the AWS CLI -------------------------------------------------------------
@pytest.mark.skipif(shutil.which("aws") is None, reason="the AWS CLI is not on PATH")
def test_aws_cli_sees_a_sane_layout(seaweedfs, tmp_path):
    store = seaweedfs.store()
    objects = {"HEAD": b"7", "versions/000000000007/manifest.json": b"{}" * 50,
               "versions/000000000007/keyframe.xc": os.urandom(6 * MiB + 1)}
    for key, data in objects.items():
        store.put(key, data)
    aws = ["aws", "--profile", seaweedfs.profile, "--endpoint-url", seaweedfs.endpoint,
           "--region", "us-east-1"]
    out = subprocess.run(aws + ["s3api", "list-objects-v2", "--bucket", store.bucket,
                                "--prefix", store._prefix], check=True, capture_output=True,
                         text=True).stdout
    listed = {o["Key"]: o["Size"] for o in json.loads(out)["Contents"]}
    assert listed == {store._prefix + k: len(v) for k, v in objects.items()}
    ls = subprocess.run(aws + ["s3", "ls", "--recursive", f"{store.url}/"], check=True,
                        capture_output=True, text=True).stdout
    print("\n" + ls)
    assert sorted(line.split()[-1] for line in ls.splitlines()) == sorted(listed)
    subprocess.run(aws + ["s3", "cp", f"{store.url}/versions/000000000007/keyframe.xc",
                          str(tmp_path / "kf")], check=True, capture_output=True)
    assert (tmp_path / "kf").read_bytes() == objects["versions/000000000007/keyframe.xc"]


def test_publisher_tags_objects_for_lifecycle_rules(s3_server):
    """Chunks and manifests carry xcluster-kind=keyframe|delta, the tag terraform's lifecycle
    rules expire by; a multipart chunk too."""
    import torch

    from xcluster import CodecConfig, Publisher, PublisherConfig

    store = s3_server.store()
    pub = Publisher(store=store, config=PublisherConfig(
        keyframe_every=100, codec=CodecConfig(block_bytes=8 * MiB, chunk_bytes=40 * MiB)))
    w = torch.randn(3 * MiB)
    pub.publish({"w": w, "big": torch.randn(10 * MiB)})  # 52 MiB of fp32: a chunk above the multipart threshold
    w2 = w.clone()
    w2[::1000] += 1
    pub.publish({"w": w2, "big": torch.zeros(0)})
    client = s3_server.client()
    kinds = {}
    for key in store.list("versions/"):
        tagset = client.get_object_tagging(Bucket=store.bucket, Key=store._full(key))["TagSet"]
        kinds[key] = {t["Key"]: t["Value"] for t in tagset}.get("xcluster-kind")
    assert kinds and all(v == ("keyframe" if "/000000000001/" in k else "delta") for k, v in kinds.items()), kinds
    assert store.stats.multipart_uploads >= 1

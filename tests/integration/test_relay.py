"""One WAN copy per cluster: a remote SeaweedFS (the trainer's region) behind a proxy that counts
the WAN bytes, two ``xcluster relay`` processes into two cluster-local SeaweedFS servers, three
subscribers behind each; a relay is killed -9 in the middle of a keyframe and restarted."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import sys
import time
import uuid

import boto3
import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber
from xcluster.store.s3.store import S3Store
from tests.integration.test_daemon import subprocess_env, wait_for
from tests.support.faultproxy import FaultProxy
from tests.support.seaweed import start_seaweedfs

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BUCKET = "xc-test"


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    sd = {f"layers.{i}.w": torch.randn(1024, 1024, generator=g).to(torch.bfloat16) for i in range(2)}
    for s in range(1, step + 1):
        gs = torch.Generator().manual_seed(100 + s)
        for t in sd.values():
            idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=gs)
            t.view(torch.int16).view(-1)[idx] += 1
    return sd


def version_bytes(store) -> int:
    return sum(store.stat(k).size for k in store.list("versions/") + store.list("files/"))


def test_two_relays_carry_one_wan_copy_each_for_six_subscribers(tmp_path, seaweedfs):
    prefix = f"relay-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{prefix}"
    remote = S3Store.from_url(url, config=seaweedfs.config())
    pub = Publisher(store=remote, config=PublisherConfig(keyframe_every=4, checkpoint_chain_fraction=None))
    digests = {}

    def publish(step: int) -> None:
        r = pub.publish(weights(step), step=step)
        digests[r.version] = r.model_digest

    publish(0)
    env = subprocess_env()
    rng = random.Random(7)
    with contextlib.ExitStack() as stack:
        wan = stack.enter_context(FaultProxy(seaweedfs.address, latency_s=0.01))
        clusters = []
        for name in ("eu", "us"):
            sw = stack.enter_context(start_seaweedfs())
            local = S3Store.from_url(url, config=seaweedfs.config(endpoint=sw.endpoint))
            boto3.session.Session(profile_name=seaweedfs.profile).client(
                "s3", endpoint_url=sw.endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
            cmd = [sys.executable, "-m", "xcluster.cli", "relay", url, url, "--src-endpoint", wan.endpoint,
                   "--dst-endpoint", sw.endpoint, "--src-profile", seaweedfs.profile, "--dst-profile",
                   seaweedfs.profile, "--poll", "0.1", "--node-id", f"relay-{name}", "--lease-interval", "1"]
            subs = [Subscriber(store=S3Store.from_url(url, config=seaweedfs.config(endpoint=sw.endpoint)))
                    for _ in range(3)]
            clusters.append({"name": name, "cmd": cmd, "local": local, "subs": subs,
                             "proc": subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE, text=True)})
        stack.callback(lambda: [c["proc"].kill() for c in clusters])

        def converged(version: int) -> bool:
            for c in clusters:
                for s in c["subs"]:
                    if s.sync() != version:
                        return False
                    assert s.model_digest == digests[version]
            return True

        wait_for(lambda: converged(1), 120, "every subscriber to reach version 1")
        kills = 0
        for step in range(1, 9):  # keyframes at 5 and 9: the relay is killed while copying them
            publish(step)
            if pub.version in (5, 9):
                time.sleep(rng.uniform(0.05, 0.4))
                victim = clusters[kills % 2]
                victim["proc"].send_signal(signal.SIGKILL)
                victim["proc"].wait(timeout=30)
                kills += 1
                victim["started_ms"] = time.time() * 1000
                victim["proc"] = subprocess.Popen(victim["cmd"], env=env, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)
            wait_for(lambda: converged(pub.version), 120, f"every subscriber to reach version {pub.version}")
        # a restarted relay is in its loop (signal handlers in place) once it has written a lease;
        # before that a SIGTERM takes the default action (the version may have been copied already
        # by the time the killed relay's successor is still importing)
        for c in clusters:
            since = c.get("started_ms", 0)
            wait_for(lambda: json.loads(remote.get(f"leases/relay-{c['name']}.json").data)["updated_unix_ms"] >= since,
                     60, f"relay-{c['name']} to be running")
        for c in clusters:
            c["proc"].send_signal(signal.SIGTERM)
            _, err = c["proc"].communicate(timeout=60)
            assert c["proc"].returncode == 0, err[-3000:]
        assert kills == 2
        # what crossed the WAN: each version once per relay (plus HEAD polls and leases); the six
        # subscribers read only their cluster's store. A relay killed -9 loses what it was copying
        # and had not written yet (at most the version in flight: it copies one at a time, and a
        # restart skips every object already in its store), so each kill may add one version.
        requests, up, down = wan.traffic()
        total = version_bytes(remote)
        largest = max(sum(remote.stat(k).size for k in remote.list(f"versions/{v:012d}/")) for v in digests)
        assert down <= 2 * total + kills * largest + 2048 * requests, (down, total, largest, requests)
        assert down >= 1.5 * total, "the relays did not carry the versions: the test proves nothing"
        for c in clusters:
            for key in remote.list("versions/"):
                assert c["local"].get(key).data == remote.get(key).data
        print(f"\nWAN bytes {down} for {total} bytes of versions ({down / total:.3f} copies), 2 relays, "
              f"6 subscribers, {kills} relay kills, {requests} WAN requests")

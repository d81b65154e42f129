"""Signed versions end to end: a trainer signing into SeaweedFS, ``xcluster subscribe --trust`` in
its own process, and someone who can write the bucket but holds no key."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from xcluster import Publisher, PublisherConfig
from xcluster.format import HEAD_KEY
from xcluster.trust.signing import generate_keypair
from xcluster.store.s3.store import S3Store
from tests.integration.test_daemon import check_current, read_lease, subprocess_env, wait_for, weights

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_trusting_daemon_ignores_unsigned_versions_and_follows_the_key_holder(tmp_path, seaweedfs):
    url = f"s3://{seaweedfs.bucket}/signed-{uuid.uuid4().hex[:8]}"
    env = subprocess_env(AWS_PROFILE=seaweedfs.profile, AWS_ENDPOINT_URL=seaweedfs.endpoint,
                         AWS_DEFAULT_REGION="us-east-1")
    store = S3Store.from_url(url, config=seaweedfs.config())
    priv, pub_key, kid = generate_keypair(tmp_path / "trainer.key")
    trainer = Publisher(store=store, config=PublisherConfig(signing_key=str(priv)))
    digests = {}
    for s in range(2):
        r = trainer.publish(weights(s), step=s)
        digests[r.version] = r.model_digest
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "xcluster.cli", "subscribe", url, "--out", str(out), "--poll", "0.05",
           "--lease-interval", "0.2", "--node-id", "node-a", "--trust", str(pub_key), "--log-format", "json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: check_current(out, digests) == 2, 90, "the daemon to apply signed version 2")
        good_head = store.get(HEAD_KEY).data
        # someone with the bucket's write credentials, but not the key, publishes version 3
        forged = Publisher(store=store).publish(weights(7), step=7)
        digests[forged.version] = forged.model_digest
        lease = wait_for(lambda: (l := read_lease(store)) and l.last_error and "SignatureError" in l.last_error
                         and l, 60, "the lease to report the refused version")
        assert lease.version == 2 and check_current(out, digests) == 2
        status = subprocess.run([sys.executable, "-m", "xcluster.cli", "status", url, "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        row = next(r for r in json.loads(status.stdout)["subscribers"] if r["node"] == "node-a")
        assert row["version"] == 2 and "not signed" in row["last_error"]
        # the operator puts HEAD back; the trainer (restarted) goes on signing; the daemon follows
        store.put(HEAD_KEY, good_head)
        trainer = Publisher(store=store, config=PublisherConfig(signing_key=str(priv)))
        r = trainer.publish(weights(2), step=2)
        assert r.version == 3 and r.model_digest != forged.model_digest
        digests[3] = r.model_digest
        wait_for(lambda: check_current(out, digests) == 3, 90, "the daemon to apply the signed version 3")
        assert kid in (store.get(HEAD_KEY).data.decode())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "SignatureError" in err

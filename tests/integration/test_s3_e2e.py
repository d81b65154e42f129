"""Publish → subscribe over S3 through a fault-injecting proxy: every applied version is the
trainer's, bit for bit, and the last one is reached."""

from __future__ import annotations

import json

import pytest
import torch

import xcluster
from tests.support.faultproxy import KINDS, FaultProxy
from xcluster.codec.digest import model_digest
from xcluster.codec.encoding import core_names
from xcluster.format.packing import unpack
from xcluster.util.retry import RetryPolicy
CORE_ENCODINGS = core_names()

pytestmark = pytest.mark.integration


def _state(step: int, g: torch.Generator, prev: dict | None) -> dict[str, torch.Tensor]:
    if prev is None:
        return {"embed.weight": torch.randn(512, 1024, generator=g),  # 2 MiB: over 5 MiB in all
                "layer.0.w": torch.randn(1024, 768, generator=g),
                "layer.0.b": torch.zeros(768),
                "head.weight": torch.randn(256, 1024, generator=g).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in prev.items()}
    for k, v in new.items():  # an RL step touches a small fraction of the weights
        flat = v.view(-1)
        idx = torch.randint(0, flat.numel(), (flat.numel() // 50,), generator=g)
        flat[idx] += (0.01 * torch.randn(idx.numel(), generator=g)).to(v.dtype)
    return new


def test_publish_subscribe_over_s3_with_faults(s3_server):
    retry = RetryPolicy(attempts=12, deadline_s=60, initial_backoff_s=0.0, max_backoff_s=0.0,
                        jitter_s=0.0)
    with FaultProxy(s3_server.address, probability=0.08, kinds=KINDS, seed=11,
                    fault_latency_s=0.05) as proxy:
        pub_store = s3_server.store(endpoint=proxy.endpoint, retry=retry, read_timeout_s=10)
        sub_store = s3_server.store(endpoint=proxy.endpoint, retry=retry, read_timeout_s=10)
        sub_store._prefix, sub_store.url = pub_store._prefix, pub_store.url  # same prefix
        pub = xcluster.Publisher(store=pub_store,
                                 config=xcluster.PublisherConfig(keyframe_every=6, checkpoint_every=4))
        # half-way the trainer restarts allowing only the core encodings (FORMAT.md §8): a planes
        # keyframe, then sparse-sub deltas, after full-exp and sparse-exp2 ones
        core = xcluster.PublisherConfig(keyframe_every=6, codec=xcluster.CodecConfig(encodings=CORE_ENCODINGS))
        applied = []
        sub = xcluster.Subscriber(store=sub_store, on_apply=applied.append)
        assert sub.sync() is None  # nothing published yet

        g = torch.Generator().manual_seed(0)
        state, digests, kinds = None, {}, {}
        for step in range(12):
            state = _state(step, g, state)
            if step == 6:
                pub = xcluster.Publisher(store=pub_store, config=core)
            result = pub.publish(state, step=step)
            digests[result.version] = model_digest(state)
            kinds[result.version] = result.kind
            if step % 3 == 2:  # the subscriber catches up now and then, several versions at once
                assert sub.sync() == result.version
        assert sub.sync() == max(digests)

    versions = sorted(digests)
    assert len(versions) >= 10 and list(kinds.values()).count("keyframe") >= 2  # a keyframe boundary
    assert model_digest(sub.state_dict()) == digests[versions[-1]]
    assert sub.version == versions[-1]
    corrupt = [a.version for a in applied if a.model_digest != digests[a.version]]
    assert corrupt == [], f"versions applied with the wrong weights: {corrupt}"
    print(f"\n[{s3_server.name}] e2e: {len(versions)} versions ({kinds}), applied "
          f"{[a.version for a in applied]}; injected {dict(proxy.counts)} in {proxy.requests} "
          f"requests; retries pub {pub_store.stats.retries} sub {sub_store.stats.retries}; "
          f"corrupt reads caught by the store {sub_store.stats.corrupt_reads}; 0 corrupt applies")
    assert sum(proxy.counts.values()) > 0
    direct = s3_server.store()  # the proxy is gone: look at the objects straight from the server
    direct._prefix, direct.url = pub_store._prefix, pub_store.url
    names = [k.rsplit("/", 1)[1] for k in direct.list("versions/") if "/manifest-" in k]
    assert len(names) >= 10 and all(n.endswith(".json.zst") for n in names)
    encodings = [set(json.loads(unpack(direct.get(k).data, where=k))["encodings"])
                 for k in sorted(direct.list("versions/")) if "/manifest-" in k]
    assert {"full-exp", "sparse-exp2"} <= set().union(*encodings[:6])
    assert set().union(*encodings[6:]) <= set(CORE_ENCODINGS)
    # the first publisher wrote checkpoints (of version 5 at least), in the layout FORMAT.md §3a gives
    cps = [k for k in direct.list("checkpoints/") if "/manifest-" in k]
    assert cps and all(json.loads(unpack(direct.get(k).data, where=k))["kind"] == "checkpoint" for k in cps)

"""Two publishers racing on one prefix, truly concurrently (threads released together by a
barrier), against real S3 servers: each round exactly one commits, the other gets a named error,
and what HEAD names is what every reader applies (docs/S3.md, conditional writes)."""

from __future__ import annotations

import threading

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber
from xcluster.read.chain import read_head
from xcluster.errors import ConcurrentPublisherError
from xcluster.write.publisher import PublishResult
from tests.unit.helpers import assert_state_equal

pytestmark = pytest.mark.integration
ROUNDS = 8


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(16, generator=g)}


def same_prefix(s3_server, like):
    store = s3_server.store()
    store._prefix, store.url = like._prefix, like.url
    return store


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_publishers_racing_on_head(s3_server):
    base = s3_server.store()
    Publisher(store=base, config=PublisherConfig(run_id="race")).publish(state(0))
    version = 1
    for r in range(ROUNDS):
        pubs = [Publisher(store=same_prefix(s3_server, base), config=PublisherConfig(run_id="race"))
                for _ in range(2)]  # both hold the same HEAD now
        gate = threading.Barrier(2)
        out: list = [None, None]

        def publish(i: int) -> None:
            gate.wait()
            try:
                out[i] = pubs[i].publish(state(100 * r + i + 1))
            except ConcurrentPublisherError as exc:
                out[i] = exc

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [i for i in range(2) if isinstance(out[i], PublishResult)]
        lost = [i for i in range(2) if isinstance(out[i], ConcurrentPublisherError)]
        assert len(won) == 1 and len(lost) == 1, f"round {r}: {out}"
        w = won[0]
        version += 1
        head, _ = read_head(base)
        assert head is not None and head.version == out[w].version == version
        sub = Subscriber(store=same_prefix(s3_server, base))
        assert sub.sync() == version
        assert sub.model_digest == out[w].model_digest
        assert_state_equal(sub.state_dict(), state(100 * r + w + 1))

"""On S3 the caller's weights are freed with the caller's last reference to them.

A failed request inside a publish (the one-time probe of conditional writes answers 412; a HEAD
that is not there yet, 404) once left a reference cycle that held the publisher's frames, and so
the caller's state_dict, until the cycle collector ran: one model's worth of memory beside the
next version's weights (bench/memory.py: 3.16x at the second keyframe). See tests/unit/test_retry_cycles.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from xcluster import Publisher, PublisherConfig

pytestmark = pytest.mark.integration


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1024, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}


def test_the_publisher_keeps_no_caller_weights_past_a_publish(s3_server):
    pub = Publisher(store=s3_server.store(), config=PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None))
    gc.collect()
    gc.disable()  # what reference counting alone frees: the bench's peak does not wait for the collector
    try:
        for step, keyframe in ((0, True), (1, False), (2, True)):
            state = _state(step)
            ref = weakref.ref(state["w"])
            assert pub.publish(state, keyframe=keyframe).kind == ("keyframe" if keyframe else "delta")
            del state
            assert ref() is None, f"version {step + 1}: the caller's weights outlived the publish"
    finally:
        gc.enable()

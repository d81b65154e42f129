"""Planning a sync reads a chain of manifests: its work and memory are bounded
(``max_plan_bytes``, one parsed manifest held at a time), and a refused chain is remembered
instead of being read and parsed again on every sync."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from xcluster.errors import FormatError, ResourceLimitError
from tests.unit.helpers import assert_state_equal
from tests.unit.test_bad_input import rewrite_manifest
from xcluster.store import LocalStore

N_TENSORS = 1000


def state(step: int) -> dict[str, torch.Tensor]:
    """Many small tensors with long names: a manifest of about 400 KiB per version."""
    return {f"layer{i:05d}." + "x" * 300: torch.full((8,), float(step + i)) for i in range(N_TENSORS)}


@pytest.fixture(scope="module")
def chain_store(tmp_path_factory):
    """v1 keyframe, then deltas 2..7, every manifest about 400 KiB."""
    root = tmp_path_factory.mktemp("chain")
    pub = Publisher(store=LocalStore(root, fsync=False), config=PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None))
    for s in range(7):
        pub.publish(state(s), step=s)
    return root


class CountingStore(LocalStore):
    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.manifest_bytes = 0
        self.manifest_reads = 0
        self.chunk_reads = 0

    def get_range(self, key, start, length):
        data = super().get_range(key, start, length)
        if "/manifest" in key:
            self.manifest_reads += 1
            self.manifest_bytes += len(data)
        elif key.endswith(".xc"):
            self.chunk_reads += 1
        return data


def manifest_size(store) -> int:
    """The bytes of version 7's manifest as a plan counts them (its canonical JSON, unpacked)."""
    from tests.unit.helpers import manifest_bytes
    return len(manifest_bytes(store, 7))


def test_plan_over_max_plan_bytes_is_refused_early(chain_store):
    store = CountingStore(chain_store)
    size = manifest_size(store)
    assert size > 256 << 10
    sub = Subscriber(store=store, config=SubscriberConfig(max_plan_bytes=3 * size))
    with pytest.raises(ResourceLimitError, match="max_plan_bytes"):
        sub.sync()
    assert sub.version is None and store.chunk_reads == 0
    assert store.manifest_reads <= 4  # stopped at the budget, not after reading the 7 manifests


def test_refused_plan_is_remembered_until_head_moves(tmp_path):
    store = CountingStore(tmp_path / "s")
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100, checkpoint_chain_fraction=None))
    for s in range(7):
        pub.publish(state(s), step=s)
    size = manifest_size(store)
    sub = Subscriber(store=store, config=SubscriberConfig(max_plan_bytes=3 * size))
    with pytest.raises(ResourceLimitError):
        sub.sync()
    store.manifest_reads = 0
    for _ in range(3):
        with pytest.raises(ResourceLimitError, match="max_plan_bytes"):
            sub.sync()
    assert store.manifest_reads == 0, "a refused chain is not read again"
    # a newer delta on the same chain is refused after reading only itself
    store.manifest_reads = 0
    pub.publish(state(7))
    assert store.manifest_reads == 0  # the publisher reads no manifest
    with pytest.raises(ResourceLimitError, match="max_plan_bytes"):
        sub.sync()
    assert store.manifest_reads == 1  # the new HEAD's manifest, then the remembered link
    pub.publish(state(8), keyframe=True)  # a keyframe: the chain restarts, the subscriber follows
    assert sub.sync() == 9
    assert_state_equal(sub.state_dict(), state(8))


def test_bad_manifest_is_not_reparsed_on_every_sync(chain_store, tmp_path):
    import shutil
    shutil.copytree(chain_store, tmp_path / "s")
    store = CountingStore(tmp_path / "s")
    sub = Subscriber(store=store)
    assert sub.sync(until=5) == 5
    rewrite_manifest(store, 7, lambda o: o.__setitem__("changed_elements", -1))
    with pytest.raises(FormatError):
        sub.sync()
    store.manifest_reads = 0
    with pytest.raises(FormatError):
        sub.sync()
    assert store.manifest_reads == 0
    assert sub.version == 5


def peak_of(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_plan_holds_one_parsed_manifest_at_a_time(chain_store):
    """Applying K versions does not hold K parsed manifests: the peak of a sync over 6 deltas
    is about that of a sync over 2 (holding them all added ~3x a manifest's bytes per version)."""
    store = LocalStore(chain_store, fsync=False)
    size = manifest_size(store)
    short, long = Subscriber(store=store), Subscriber(store=store)
    assert short.sync(until=5) == 5 and long.sync(until=1) == 1
    p2 = peak_of(lambda: short.sync())
    p6 = peak_of(lambda: long.sync())
    assert long.version == short.version == 7
    assert_state_equal(long.state_dict(), state(6))
    assert p6 < p2 + 2 * size, f"6 deltas peak at {p6 / size:.1f}x a manifest, 2 deltas at {p2 / size:.1f}x"

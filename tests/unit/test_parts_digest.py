"""Tensors assembled from parts (FORMAT.md §6 parts digest): parsed strictly, verified by subscribers.

Manifests are rewritten by hand here (as a sharded publisher would write them), so the reader's
side is tested without torch.distributed; tests/unit/test_distributed.py covers the writer."""

from __future__ import annotations

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber, model_digest
from xcluster.codec.digest import combine_part_digests, entry_digest, model_digest_from, tensor_digest
from xcluster.errors import DigestMismatchError, FormatError, SchemaVersionError
from xcluster.format import parse_manifest
from xcluster.store import LocalStore
from tests.unit.helpers import assert_state_equal, manifest_bytes
from tests.unit.test_bad_input import rewrite_manifest as rewrite


def states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(10, 4, generator=g)
    w2 = w.clone()
    w2.view(torch.int16).reshape(-1)[::7] += 1
    return [{"w": w, "b": b}, {"w": w2, "b": b.clone()}]  # "b" unchanged in version 2




def with_parts(state, name: str, parts: list[int], *, digest: str | None = None, format_version: int = 1):
    """A mutation: tensor ``name`` hashed in ``parts``; model digest recomputed to match."""
    def mutate(o):
        o["format_version"] = format_version
        for t in o["tensors"]:
            if t["name"] == name:
                t["parts"] = parts
                t["digest"] = digest or entry_digest(state[name], parts)
        o["model_digest"] = model_digest_from((t["name"], t["dtype"], t["shape"], t["digest"]) for t in o["tensors"])
    return mutate


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "s")


def test_parts_digest_is_the_digest_of_each_part(store):
    t = states()[0]["w"]
    flat = t.reshape(-1)
    want = combine_part_digests([(600, tensor_digest(flat[:600])), (1448, tensor_digest(flat[600:]))])
    assert entry_digest(t, [600, 1448]) == want
    assert entry_digest(t, None) == tensor_digest(t)
    assert want != entry_digest(t, [601, 1447])  # the boundaries are part of the digest
    assert want != tensor_digest(t)


def test_keyframe_with_parts_verifies_and_reconstructs(store):
    s = states()
    Publisher(store=store).publish(s[0])
    rewrite(store, 1, with_parts(s[0], "w", [20 * 32, 44 * 32]))
    sub = Subscriber(store=store)
    assert sub.sync() == 1
    assert_state_equal(sub.state_dict(), s[0])
    assert sub.manifest.tensors[1].parts == (640, 1408)
    assert sub.model_digest == model_digest(s[0], parts={"w": [640, 1408]}) != model_digest(s[0])
    # a daemon restarting from its saved weights re-verifies them under the same rule
    again = Subscriber(store=store)
    assert again.restore(sub.state_dict(), sub.snapshot().manifest_data) == 1


def test_wrong_parts_digest_is_refused(store):
    s = states()
    Publisher(store=store).publish(s[0])
    bad = entry_digest(s[0]["w"], [32, 63 * 32])  # another split's digest
    rewrite(store, 1, with_parts(s[0], "w", [20 * 32, 44 * 32], digest=bad))
    sub = Subscriber(store=store)
    with pytest.raises(DigestMismatchError, match="w hashes to"):
        sub.sync()
    assert sub.version is None


@pytest.mark.parametrize("parts, format_version, error", [
    ([2048], 1, FormatError),            # one part: the plain digest, never a parts list
    ([1000, 1000], 1, FormatError),      # does not add up to numel
    ([0, 2048], 1, FormatError),         # empty part
    ([1024, 1024], 99, SchemaVersionError),
])
def test_bad_parts_are_format_errors(store, parts, format_version, error):
    s = states()
    Publisher(store=store).publish(s[0])
    rewrite(store, 1, with_parts(s[0], "w", parts, digest="0" * 32, format_version=format_version))
    with pytest.raises(error):
        Subscriber(store=store).sync()
    with pytest.raises(error):
        parse_manifest(manifest_bytes(store, 1))


def test_unchanged_tensor_rehashed_in_new_parts_is_verified(store):
    """A delta may state another digest for a tensor it does not touch (hashed in other parts):
    the subscriber hashes it again instead of trusting the base's digest, and refuses a lie."""
    s = states()
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=10))
    pub.publish(s[0])
    pub.publish(s[1])
    m2 = parse_manifest(manifest_bytes(store, 2))
    assert m2.kind == "delta" and not any(seg.tensor == 0 for b in m2.blocks for seg in b.segments)  # "b" untouched
    sub = Subscriber(store=store)
    assert sub.sync(until=1) == 1
    rewrite(store, 2, with_parts(s[1], "b", [8, 32]))
    assert sub.sync() == 2
    assert_state_equal(sub.state_dict(), s[1])

    sub = Subscriber(store=store)
    assert sub.sync(until=1) == 1
    rewrite(store, 2, with_parts(s[1], "b", [8, 32], digest=entry_digest(s[1]["b"] + 1, [8, 32])))
    with pytest.raises(DigestMismatchError, match="unchanged from the verified base"):
        sub.sync()
    assert sub.version == 1

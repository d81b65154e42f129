"""Every version a reader accepts is authenticated by HEAD: hash links lead from HEAD back to it,
across keyframes (``prev_manifest``). A replaced old version is refused, never reported verified."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from xcluster import Publisher, PublisherConfig, Subscriber
from xcluster.read.chain import find_link, read_head
from xcluster.cli import main
from xcluster.errors import ChainBrokenError, ChecksumMismatchError, FormatError
from xcluster.format import parse_manifest, version_dir
from xcluster.store import LocalStore
from xcluster.format.packing import unpack
from tests.unit.helpers import assert_state_equal, manifest_bytes, mkey
from tests.unit.test_bad_input import rewrite_manifest, weights


def publish(store, *, keyframes=(3,), n=4):
    """v1 keyframe, deltas, a keyframe at each of ``keyframes``."""
    pub = Publisher(store=store, config=PublisherConfig(keyframe_every=100))
    for v in range(1, n + 1):
        pub.publish(weights(v), step=v, keyframe=v in keyframes or None)
    return pub


def forge_version_1(store, tmp_path) -> None:
    """Replace versions/1/ with a self-consistent keyframe of other weights (another store's
    manifest and chunks, under the committed manifest's name): every hash inside agrees."""
    other = LocalStore(tmp_path / "forger")
    Publisher(store=other).publish({"w": torch.zeros(256, 256, dtype=torch.bfloat16), "b": torch.ones(16)})
    real = mkey(store, 1)
    for p in (tmp_path / "forger" / version_dir(1)).iterdir():
        if p.name.startswith("c"):
            shutil.copy(p, store.root / version_dir(1) / p.name)
        else:
            (store.root / real).write_bytes(p.read_bytes())


def test_replaced_version_behind_the_keyframe_is_refused(tmp_path):
    store = LocalStore(tmp_path / "s")
    publish(store)
    key = mkey(store, 1)  # before the forgery: the committed manifest's name
    forge_version_1(store, tmp_path)
    assert parse_manifest(unpack(store.get(key).data, where=key)).version == 1  # a well-formed, self-consistent v1
    sub = Subscriber(store=store)
    with pytest.raises(ChecksumMismatchError, match="replaced"):
        sub.sync(until=1)
    assert sub.version is None
    assert main(["verify", str(tmp_path / "s"), "--version", "1"]) == 2
    assert sub.sync() == 4  # HEAD's own chain is intact


def test_old_versions_are_reached_through_keyframes(tmp_path):
    store = LocalStore(tmp_path / "s")
    publish(store, keyframes=(3, 4), n=5)
    head, _ = read_head(store)
    for v in range(1, 6):
        sub = Subscriber(store=store)
        assert sub.sync(until=v) == v
        assert_state_equal(sub.state_dict(), weights(v))
        assert find_link(store, head, v).version == v
    m3 = parse_manifest(manifest_bytes(store, 3))
    m2 = parse_manifest(manifest_bytes(store, 2))
    assert m3.kind == "keyframe" and m3.prev_manifest is not None
    assert (m3.prev_manifest.version, m3.prev_manifest.manifest) == (2, mkey(store, 2).rsplit("/", 1)[1])
    assert m2.prev_manifest is not None and m2.prev_manifest.version == m2.base_version
    assert parse_manifest(manifest_bytes(store, 1)).prev_manifest is None


def test_walk_to_an_old_version_is_bounded(tmp_path):
    store = LocalStore(tmp_path / "s")
    publish(store, keyframes=(2, 3, 4, 5), n=6)
    head, _ = read_head(store)
    with pytest.raises(ChainBrokenError, match="max_chain"):
        find_link(store, head, 1, max_chain=3)
    assert find_link(store, head, 3, max_chain=3).version == 3


def test_store_without_prev_links_refuses_old_versions(tmp_path):
    """A store written before prev_manifest (schema 1, or schema 2 without the field): versions
    behind HEAD's keyframe cannot be authenticated and are refused; HEAD's chain still reads."""
    store = LocalStore(tmp_path / "s")
    publish(store, n=3)
    rewrite_manifest(store, 3, lambda o: o.pop("prev_manifest"))
    sub = Subscriber(store=store)
    with pytest.raises(ChainBrokenError, match="authenticated"):
        sub.sync(until=2)
    assert sub.version is None
    assert sub.sync() == 3
    assert_state_equal(sub.state_dict(), weights(3))


@pytest.mark.parametrize("mutate", [
    lambda o: o["prev_manifest"].__setitem__("version", 1),  # not the previous version
    lambda o: o["prev_manifest"].__setitem__("xxh3_128", "0" * 32),  # a delta's must be its base link
    lambda o: o["prev_manifest"].__setitem__("manifest", "../HEAD"),
    lambda o: o.__setitem__("prev_manifest", [2, "manifest.json", "0" * 32]),
])
def test_bad_prev_manifest_is_a_format_error(tmp_path, mutate):
    store = LocalStore(tmp_path / "s")
    publish(store, keyframes=(), n=3)
    obj = json.loads(manifest_bytes(store, 3))
    mutate(obj)
    with pytest.raises(FormatError):
        parse_manifest(json.dumps(obj).encode())

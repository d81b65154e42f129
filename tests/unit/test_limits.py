"""Resource limits: a hostile manifest that is well-formed by every other rule cannot make a
subscriber allocate past its limits or raise anything but a named XclusterError, and it keeps
serving its last good weights."""

from __future__ import annotations

import os

import pytest

from xcluster import Subscriber, SubscriberConfig
from xcluster.errors import FormatError, ResourceLimitError
from xcluster.format import parse_manifest, xxh3_128
from tests.unit.helpers import mkey
from tests.unit.test_bad_input import assert_untouched, env, rewrite_manifest  # noqa: F401 - fixture

HUGE = 1 << 39  # 512 GiB of uint8: under the default max_model_bytes (1 TiB)


def add_tensor(o: dict, name: str, shape: list[int]) -> int:
    o["tensors"].append({"name": name, "dtype": "uint8", "shape": shape, "digest": "0" * 32, "init": "none"})
    return len(o["tensors"]) - 1


def add_huge_tensor(o: dict) -> None:
    """A 512 GiB uint8 tensor, fully covered by planes segments whose streams claim 64 GiB each
    (all well-formed), carried by an 8-byte chunk: only an allocation limit stops it."""
    t = add_tensor(o, "zz_huge", [HUGE])
    ci = len(o["chunks"])
    o["chunks"].append({"name": "chuge-000000.xc", "size": 8, "xxh3_128": xxh3_128(b"\0" * 8)})
    per_block = (1 << 36) // (1 << 31)
    for b in range(HUGE // (1 << 36)):
        o["blocks"].append({"chunk": ci, "offset": b, "encoding": "planes", "width": 1,
                            "streams": [["zstd", 1, 1 << 36]],
                            "segments": [[t, (b * per_block + k) << 31, 1 << 31, 1 << 31]
                                         for k in range(per_block)]})


@pytest.mark.parametrize("shape", [[0, 1 << 40, 1 << 30], [1 << 52, 1 << 52, 0], [0] + [1 << 10] * 8])
def test_zero_element_tensor_whose_strides_overflow_is_a_format_error(env, shape):
    """numel is 0, but torch computes strides (and storage size) with every dim counted as at
    least 1: their product overflows int64 inside torch.empty. Refused when parsing."""
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, lambda o: add_tensor(o, "zz_empty", shape))
    with pytest.raises(FormatError, match="zz_empty"):
        sub.sync()
    assert_untouched(sub, before)


def test_tensor_over_max_tensor_bytes_is_refused_before_fetching(env):
    store, _, _ = env
    sub = Subscriber(store=store, config=SubscriberConfig(max_tensor_bytes=1 << 30))
    sub.sync(until=1)
    before = sub.model_digest
    rewrite_manifest(store, 2, add_huge_tensor)
    fetched = []
    real = store.get_range
    store.get_range = lambda k, s, n: (fetched.append(k), real(k, s, n))[1]
    with pytest.raises(ResourceLimitError, match="zz_huge.*max_tensor_bytes"):
        sub.sync()
    assert not [k for k in fetched if k.endswith(".xc")]  # refused before any chunk was fetched
    assert_untouched(sub, before)


@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >= HUGE,
                    reason="this machine could allocate 512 GiB")
def test_allocation_failure_is_a_named_error(env):
    """512 GiB passes every cap of the default config; torch.empty then fails: a named error,
    not a bare RuntimeError, and the last good weights stay."""
    store, _, sub = env
    before = sub.model_digest
    rewrite_manifest(store, 2, add_huge_tensor)
    store.put("versions/000000000002/chuge-000000.xc", b"\0" * 8)
    m = parse_manifest(store.get(mkey(store, 2)).data)
    assert m.model_bytes < SubscriberConfig().max_model_bytes
    with pytest.raises(ResourceLimitError, match="zz_huge"):
        sub.sync()
    assert_untouched(sub, before)

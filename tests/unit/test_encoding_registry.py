"""The Encoding registry is the one seam: an encoding that only registers itself is written by the
encoder, dispatched by the decoder, checked by the manifest parser and refused by name where a
reader lacks it (codec/encoding.py)."""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import torch

from xcluster import CodecConfig, Publisher, PublisherConfig, Subscriber
from xcluster.codec import encoding
from xcluster.codec.encoding import FILL, BlockStreams, DecodeInput, Fill, RangeInput
from xcluster.errors import ConfigError, DecompressionBombError, UnknownEncodingError
from xcluster.format import canonical_json
from tests.support.encodings import without_encodings
from tests.unit.helpers import assert_state_equal, manifest_bytes, memory_store


class RawBits:
    """A toy fill encoding: the raw bits of the values, one stream. It always takes the range."""

    name, kind, core, reads_range = "raw-bits", FILL, False, False
    dtypes = ("float32", "bfloat16")

    def stream_lengths(self, width, segments, dtypes):
        return [(width * sum(s.count for s in segments), True)]

    def stream_level(self, stream, level):
        return level

    def memory(self, block):
        return sum(s.raw for s in block.streams)

    def on_device(self, old, pos, dtype, *, start, row):
        return None

    def offer(self, r: RangeInput, best, stored, config):
        return [np.ascontiguousarray(r.bits).view(np.uint8)]

    def decode(self, streams: BlockStreams, d: DecodeInput):
        data = streams.stream(0)
        w = streams.block.width
        ops, at = [], 0
        for seg in streams.block.segments:
            bits = data[at:at + w * seg.count].view({2: np.uint16, 4: np.uint32}[w])
            ops.append(Fill(seg.tensor, seg.start, [bits]))
            at += w * seg.count
        return ops


@contextlib.contextmanager
def registered(enc):
    encoding.registry()  # the built-in ones first
    try:
        with mock.patch.dict(encoding._REGISTRY):
            encoding.register(enc)
            yield
    finally:
        encoding._loaded.cache_clear()


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 64, generator=gen) * 0.02).to(torch.bfloat16),
            "f": torch.randn(3000, generator=gen), "i": torch.arange(50, dtype=torch.int64)}


def test_an_encoding_that_registers_itself_is_written_read_and_refused_by_name():
    sd = weights(1)
    with registered(RawBits()):
        assert "raw-bits" in encoding.names() and "raw-bits" not in encoding.core_names()
        store = memory_store()
        Publisher(store=store, config=PublisherConfig(codec=CodecConfig())).publish(sd)
        data = manifest_bytes(store, 1)
        m = encoding.parse_manifest(data)
        used = {m.tensors[s.tensor].name: b.encoding for b in m.blocks for s in b.segments}
        assert used == {"w": "raw-bits", "f": "raw-bits", "i": "planes"}  # int64 is not among its dtypes
        assert m.encodings == ("planes", "raw-bits")
        sub = Subscriber(store=store)
        assert sub.sync() == 1
        assert_state_equal(sub.state_dict(), sd)

        with without_encodings("raw-bits"):  # a reader of the same store without it
            with pytest.raises(UnknownEncodingError, match="uses encoding 'raw-bits'"):
                Subscriber(store=store).sync()
        # its limits are checked by the parser, from its module alone
        bad = json.loads(data)
        blk = next(b for b in bad["blocks"] if b["encoding"] == "raw-bits")
        blk["streams"][0][2] += 2
        with pytest.raises(DecompressionBombError, match="stream 0 declares"):
            encoding.parse_manifest(canonical_json(bad))

    # and once it is gone, this build refuses the store it wrote, by name
    with pytest.raises(UnknownEncodingError, match="raw-bits"):
        Subscriber(store=store).sync()


def test_allowed_encodings_come_from_the_registry():
    with pytest.raises(ConfigError, match="encodings must name only"):
        CodecConfig(encodings=(*encoding.core_names(), "raw-bits"))
    with registered(RawBits()):
        assert CodecConfig(encodings=(*encoding.core_names(), "raw-bits")).encodings[-2:] == ("raw-bits", "sparse-sub")

"""A rank's part of a sharded version as it travels to rank 0, and rank 0's merge of the parts.

A part is plain JSON (see :mod:`xcluster.write.shard_exchange`): the bytes the rank uploaded, the
elements it changed, and its tensor, chunk and block entries, with chunk numbers local to the rank
and segments at offsets within the rank's slice. :func:`merge_parts` makes them the entries of one
ordinary manifest (docs/FORMAT.md §6 and §10).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..codec.digest import combine_part_digests
from ..codec.encode import EncodedVersion
from ..errors import ShardedPublishError
from ..format import BlockEntry, ChunkEntry, Segment, StreamEntry, TensorEntry
from .shard_layout import part_count


def describe_part(encoded: EncodedVersion, uploaded: int, layout: Sequence[list]) -> dict[str, Any]:
    """This rank's part: what it encoded (``layout``: its rows of
    :func:`~xcluster.write.shard_layout.prepare_shard`) and uploaded (``uploaded`` bytes)."""
    offsets = {row[0]: row[3] for row in layout}
    return {"error": None, "bytes": uploaded, "changed": encoded.changed_elements,
            "tensors": [[t.name, offsets[t.name], t.digest, t.init] for t in encoded.tensors],
            "chunks": [[c.name, c.size, c.xxh3_128] for c in encoded.chunks],
            "blocks": [[b.chunk, b.offset, b.encoding, b.width, [[s.codec, s.stored, s.raw] for s in b.streams],
                        [[s.tensor, s.start, s.count, s.nnz] for s in b.segments]] for b in encoded.blocks]}


def merge_parts(parts: list[dict], layout: dict[str, dict]
                ) -> tuple[tuple[TensorEntry, ...], tuple[ChunkEntry, ...], tuple[BlockEntry, ...]]:
    """The entries of one manifest: tensors sorted by name, each rank's chunks and blocks in rank
    order, segments moved from the rank's slice to the global tensor's element offsets.
    ``layout`` is :func:`~xcluster.write.shard_layout.check_layout`'s."""
    names = sorted(layout)
    index = {n: i for i, n in enumerate(names)}
    pieces: dict[str, list[tuple[int, int, str, str]]] = {n: [] for n in names}  # (offset, count, digest, init)
    for p in parts:
        for name, off, digest, init in p["tensors"]:
            pieces[name].append((off, part_count(layout[name], off), digest, init))
    tensors: list[TensorEntry] = []
    for n in names:
        ps = sorted(pieces[n])
        ps = [p for p in ps if p[1] > 0] or ps[:1]  # a tensor without elements: any rank may pass it
        inits = {init for _, _, _, init in ps}
        if len(inits) != 1:  # the bases of the ranks disagree: never commit a mix
            raise ShardedPublishError(f"the parts of {n} disagree on init ({sorted(inits)}): the ranks' bases "
                                      "are out of step; refusing to commit a mix")
        dtype, shape = layout[n]["dtype"], tuple(layout[n]["shape"])
        if len(ps) == 1:
            tensors.append(TensorEntry(n, dtype, shape, ps[0][2], ps[0][3]))
        else:
            tensors.append(TensorEntry(n, dtype, shape, combine_part_digests((k, d) for _, k, d, _ in ps),
                                       ps[0][3], tuple(k for _, k, _, _ in ps)))
    chunks: list[ChunkEntry] = []
    blocks: list[BlockEntry] = []
    for p in parts:
        base_chunk = len(chunks)
        chunks.extend(ChunkEntry(*ch) for ch in p["chunks"])
        local = p["tensors"]  # the rank's tensors in its encoder's order (sorted by name)
        for chunk, offset, encoding, width, streams, segments in p["blocks"]:
            blocks.append(BlockEntry(
                base_chunk + chunk, offset, encoding, width, tuple(StreamEntry(*s) for s in streams),
                tuple(Segment(index[local[t][0]], local[t][1] + start, count, nnz)
                      for t, start, count, nnz in segments)))
    return tuple(tensors), tuple(chunks), tuple(blocks)

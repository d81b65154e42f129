"""The change scan with torch ops, on the device the tensors live on.

Same bytes as the numpy scan (changes.py, FORMAT §5), but only what changed crosses to the host:
for a sparse range the gaps, the zigzag diffs and the new values at the changed positions (the
values keep the publisher's host copy of the weights, which the digests are taken from, in step);
for a dense range the zigzag diffs and the new values of the range. Each range is at most
``block_bytes`` of elements (8 Mi bf16 elements by default), so the device memory a scan needs is
a few times that per worker, whatever the model's size.

Raw bits are compared as signed integer views (``flat_bits``); differences are taken in a wider
signed dtype and masked to the element's width (torch has no uint16/uint32 arithmetic), except for
8-byte elements, whose int64 arithmetic wraps in two's complement like the format's.
"""

from __future__ import annotations

import numpy as np
import torch

from .dtypes import UINT, flat_bits
from .kernels.changes import join_planes, split_planes

_WIDE = {1: torch.int32, 2: torch.int32, 4: torch.int64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFF_FFFF}


def _unsigned(bits: torch.Tensor, w: int) -> torch.Tensor:
    """The raw bits of a signed view of width ``w`` < 8 as non-negative values of a wider dtype."""
    return bits.to(_WIDE[w]).bitwise_and_(_MASK[w])


def zigzag_bytes(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``zigzag(new - old mod 2**bits)`` of two integer views of one width, as an ``(n, w)`` uint8
    tensor (row j holds the little-endian bytes of element j)."""
    w = new.element_size()
    if w == 8:
        d = new - old
        z = (d << 1) ^ (d >> 63)
    else:
        d = (_unsigned(new, w) - _unsigned(old, w)).bitwise_and_(_MASK[w])
        z = ((d << 1) ^ -(d >> (8 * w - 1))).bitwise_and_(_MASK[w])
    return z.view(torch.uint8).reshape(-1, z.element_size())[:, :w]


def find_changes(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where two integer views of one width differ: sorted int64 positions and the old and new
    values there (on their device). As in changes.py, elements narrower than 8 bytes are compared
    a 64-bit word at a time first, so the mask and the nonzero pass are 8/width times smaller."""
    w = new.element_size()
    per = 8 // w
    aligned = old.storage_offset() % per == new.storage_offset() % per == 0  # views as int64 need it
    main = new.numel() - new.numel() % per if per > 1 and aligned else 0
    parts = []
    if main:
        o64, n64 = old[:main].view(torch.int64), new[:main].view(torch.int64)
        words = torch.ne(o64, n64).nonzero().squeeze(1)
        ow = o64.index_select(0, words).view(old.dtype)
        nw = n64.index_select(0, words).view(new.dtype)
        lanes = torch.ne(ow, nw).nonzero().squeeze(1)
        pos = words.index_select(0, torch.div(lanes, per, rounding_mode="floor")).mul_(per).add_(lanes % per)
        parts.append((pos, ow.index_select(0, lanes), nw.index_select(0, lanes)))
    if main < new.numel():
        idx = torch.ne(old[main:], new[main:]).nonzero().squeeze(1)
        parts.append((idx + main, old[main:].index_select(0, idx), new[main:].index_select(0, idx)))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


def _rows_to_host(parts: list[torch.Tensor]) -> np.ndarray:
    """Stack ``(n, k_i)`` uint8 tensors as rows of one ``(Σ k_i, n)`` array and copy it to the host
    in one transfer; row i is then one byte plane."""
    n = parts[0].shape[0]
    out = torch.empty((sum(p.shape[1] for p in parts), n), dtype=torch.uint8, device=parts[0].device)
    r = 0
    for p in parts:
        out[r:r + p.shape[1]] = p.t()
        r += p.shape[1]
    return out.cpu().numpy()


def _bytes(bits: torch.Tensor) -> torch.Tensor:
    w = bits.element_size()
    return bits.view(torch.uint8).reshape(-1, w)


def field_ranks(old: torch.Tensor, pos: torch.Tensor, shift: int, nbits: int) -> tuple[np.ndarray, ...]:
    """The changes grouped by the bit field ``(u >> shift) & (2**nbits - 1)`` of their base value,
    with torch ops on ``old``'s device (signed integer view of the range, changed positions
    ``pos``): their order by group, rank within it, the group sizes and counts (as
    ``sparse_exp2.group_ranks`` gives them); only per-change results cross to the host."""
    groups = (_unsigned(old, old.element_size()) >> shift).bitwise_and_((1 << nbits) - 1)
    cg = groups.index_select(0, pos)
    counts = torch.bincount(cg, minlength=1 << nbits)
    order = torch.sort(cg, stable=True).indices
    sizes = torch.zeros(1 << nbits, dtype=torch.int64, device=old.device)
    ranks = torch.empty(pos.numel(), dtype=torch.int64, device=old.device)
    start = 0
    for g, n in enumerate(counts.tolist()):
        if not n:
            continue
        seen = torch.cumsum(torch.eq(groups, g), 0, dtype=torch.int64)
        sizes[g] = seen[-1]
        ranks[start:start + n] = seen.index_select(0, pos.index_select(0, order[start:start + n])) - 1
        start += n
    return tuple(t.cpu().numpy() for t in (order, ranks, sizes, counts))


def scan_range(new: torch.Tensor, old: torch.Tensor | None, start: int, end: int, dense_threshold: float,
               prepare=None):
    """Encode elements ``[start, end)`` of ``new`` against ``old`` (None: carried as planes).

    Returns None when nothing changed, else ``(kind, streams, nnz, positions, values)``: ``kind`` is
    ``"planes"``, ``"dense"`` or ``"sparse"``; ``streams`` the host byte planes of the segment
    (FORMAT §5); ``positions`` the absolute int64 positions of a sparse range; ``values`` the new raw
    bits as an unsigned host array (at the positions, or of the whole dense range; None for planes).
    A sparse range also carries ``prepare(old_bits, positions)`` (run on the device) as a sixth
    item, where ``prepare`` is given (else None): an encoding's :meth:`Encoding.on_device` work.
    """
    w = new.element_size()
    nb = flat_bits(new)[start:end]
    count = end - start
    if old is None:
        host = nb.cpu().numpy().view(UINT[w])
        return "planes", split_planes(host), count, None, None, None
    ob = flat_bits(old)[start:end].to(nb.device)
    pos, ov, nv = find_changes(ob, nb)
    nnz = int(pos.numel())
    if nnz == 0:
        return None
    if nnz >= dense_threshold * count:
        rows = _rows_to_host([zigzag_bytes(ob, nb), _bytes(nb)])
        return "dense", list(rows[:w]), nnz, None, join_planes(list(rows[w:]), UINT[w]), None
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1)).sub_(1)  # < 2**31: a range is at most 2**31 elements
    rows = _rows_to_host([_bytes(gaps)[:, :4], zigzag_bytes(ov, nv), _bytes(nv)])
    streams = list(rows[:4 + w])
    positions = np.cumsum(join_planes(streams[:4], np.uint32), dtype=np.int64)
    positions += np.arange(1, nnz + 1, dtype=np.int64) + (start - 1)
    prep = prepare(ob, pos) if prepare is not None else None
    return "sparse", streams, nnz, positions, join_planes(list(rows[4 + w:]), UINT[w]), prep

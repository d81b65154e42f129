"""``sparse-rows``: ``sparse-exp2`` over the rows of a table that hold a change (FORMAT.md §5f).

An embedding table's gradient reaches only the rows of the tokens a batch holds, so a step changes
a few rows of it and leaves the rest bit for bit: on the real-weights run (bench/contexts.py) about
1% of all-MiniLM-L6-v2's word-embedding rows change per step, with a few changes each. Coded as
``sparse-exp2`` over the whole table, each change pays for the positions of a 0.01% density, and a
reader's pass over every element (which is why ``sparse-exp2`` leaves such ranges ``sparse-sub``);
coded here, the segment names its **active rows** (Rice-coded row gaps) and the changes are a
``sparse-exp2`` segment over those rows' elements only: positions at the density inside the active
rows, and a reader that touches only them.

A row is ``shape[-1]`` elements of a tensor of two or more dimensions; a segment's rows are clipped
to its range, so a range need not start or end on a row.

Pure: numpy arrays in, numpy arrays out.
"""

from __future__ import annotations

import numpy as np

from ...errors import DecodeError
from ..encoding import SPARSE, BlockStreams, DecodeInput, Op, RangeInput, Scatter, register, stored_bytes
from ..kernels import exprank
from ..kernels.changes import UINT, unzigzag
from . import sparse_exp2 as exp2

N_STREAMS = exp2.N_STREAMS + 3
ROW_HEAD, ROW_QUOTIENTS, ROW_REMAINDERS = range(exp2.N_STREAMS, N_STREAMS)
STREAM_NAMES = exp2.STREAM_NAMES + ("row head", "row quotient", "row remainder")
HEAD_BYTES = 5
"""The row head piece: the number of active rows (uint32 LE), then their Rice parameter (one byte)."""

MIN_CHANGES = 8
"""Ranges with fewer changes are not tried (a segment's side information, the group counts of its
``sparse-exp2`` part and its row head, outweighs what it could save)."""

MAX_ACTIVE = 0.25
"""The trial is skipped when the active rows hold more than this share of the range's elements: the
rows then say little about where the changes are (a dense matrix changes in nearly every row), and
plain ``sparse-exp2`` over the range is as small. Measuring the share costs one pass over the
changes."""


# --- rows and their elements ---------------------------------------------------------------
def row_spans(start: int, count: int, row: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the elements ``[lo, hi)`` of the range (relative to ``start``) in each of the
    ``rows`` (relative row numbers: row 0 holds the range's first element)."""
    off = start % row
    rows = rows.astype(np.int64, copy=False)
    return np.maximum(rows * row - off, 0), np.minimum((rows + 1) * row - off, count)


def layout(start: int, count: int, row: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, cum)``: the rows' element spans (:func:`row_spans`) and where each begins in the
    gathered range (``cum[i]``; ``cum[-1]`` its length)."""
    lo, hi = row_spans(start, count, row, rows)
    cum = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(hi - lo, out=cum[1:])
    return lo, hi, cum


def n_rows(start: int, count: int, row: int) -> int:
    """How many rows the range ``[start, start + count)`` meets."""
    return (start % row + count + row - 1) // row


def gather(rng: np.ndarray, start: int, row: int, rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The elements of ``rows`` in the range ``rng`` (raw bits), row after row: the full rows by one
    indexed copy, a partial first and last row by slices."""
    m = rows.size
    if m == 0:
        return rng[:0].copy()
    parts = []
    first = 0
    if lo[0] == 0 and hi[0] - lo[0] < row:  # the range starts inside row 0, or holds less than a row
        parts.append(rng[lo[0]:hi[0]])
        first = 1
    last = m
    tail = None
    if last > first and hi[m - 1] - lo[m - 1] < row:  # the range ends inside its last row
        tail = rng[lo[m - 1]:hi[m - 1]]
        last -= 1
    if last > first:
        base = (row - start % row) % row  # the first element of the first full row
        full = rng[base:base + (rng.size - base) // row * row].reshape(-1, row)
        parts.append(full[(lo[first:last] - base) // row].reshape(-1))
    if tail is not None:
        parts.append(tail)
    return np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])


def _active(pos: np.ndarray, start: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """The active rows (relative, ascending) of the sorted positions ``pos`` and, per position, the
    index of its row among them."""
    r = (pos.astype(np.int64, copy=False) + start % row) // row
    new = np.empty(r.size, dtype=bool)
    new[:1] = True
    np.not_equal(r[1:], r[:-1], out=new[1:])
    return r[new], np.cumsum(new) - 1


# --- writing ---------------------------------------------------------------------------------
def build(old: np.ndarray, pos: np.ndarray, z: np.ndarray, dtype: str, start: int, row: int) -> list[np.ndarray]:
    """The eight stream pieces of one segment: its range's base bits ``old``, the sorted relative
    changed positions and their zigzag diffs (in position order), the range's first element in its
    tensor and the tensor's row length."""
    return _build(old, pos, z, dtype, start, row, *_active(pos, start, row))


def _build(old, pos, z, dtype, start, row, rows, which) -> list[np.ndarray]:
    """:func:`build` given the active rows and each change's row among them (:func:`_active`)."""
    lo, hi, cum = layout(start, old.size, row, rows)
    inner = cum[which] + (pos.astype(np.int64) - lo[which])
    return pack(gather(old, start, row, rows, lo, hi), inner, z, dtype, rows, n_rows(start, old.size, row))


def pack(gathered: np.ndarray, inner: np.ndarray, z: np.ndarray, dtype: str, rows: np.ndarray,
         total: int) -> list[np.ndarray]:
    """The eight pieces from the gathered range (base bits of the active ``rows``' elements),
    the changes' positions in it and their zigzag diffs, and the segment's number of rows."""
    return exp2.build(gathered, inner, z, dtype) + _row_pieces(rows, total)


def _row_pieces(rows: np.ndarray, total: int) -> list[np.ndarray]:
    n = np.array([rows.size], dtype=np.int64)
    k = exp2.rice_k(np.array([total]), n)
    head = np.zeros(HEAD_BYTES, dtype=np.uint8)
    head[:4] = np.frombuffer(int(rows.size).to_bytes(4, "little"), dtype=np.uint8)
    head[4] = k[0]
    coded = exprank.rice_code(rows, n, k)
    unary, rem = coded if coded is not None else exp2._rice_numpy(rows.astype(np.int64), n, k)
    return [head, unary, rem]


# --- reading ---------------------------------------------------------------------------------
class _RowReader:
    """The row streams of a block, read segment by segment."""

    def __init__(self, streams: list[np.ndarray], width: int, where: str) -> None:
        empty = np.zeros(0, dtype=np.uint8)
        self.head, self.at = streams[ROW_HEAD], 0
        self.where = where
        # the row gaps are one Rice-coded group: read with sparse-exp2's Rice reader on these streams
        self.rice = exp2.SegmentReader([empty, streams[ROW_QUOTIENTS], streams[ROW_REMAINDERS], empty, empty],
                                       width, where)

    def rows(self, total: int, nnz: int) -> np.ndarray:
        """The active rows of the next segment (relative, ascending), checked against its ``total``
        rows and ``nnz`` changes."""
        where = self.where
        if self.at + HEAD_BYTES > self.head.size:
            raise DecodeError(f"{where}: the row head stream ends early ({self.head.size} bytes)")
        h = self.head[self.at:self.at + HEAD_BYTES]
        self.at += HEAD_BYTES
        m, k = int.from_bytes(h[:4].tobytes(), "little"), int(h[4])
        if not 0 < m <= min(nnz, total):
            raise DecodeError(f"{where}: {m} active rows for a segment of {nnz} changes over {total} rows")
        if k > 31:
            raise DecodeError(f"{where}: the rows' Rice parameter is over 31")
        n = np.array([m], dtype=np.int64)
        rows = self.rice._ranks(m, n, np.array([k], dtype=np.int64), np.array([0, m], dtype=np.int64))
        if int(rows[-1]) >= total:
            raise DecodeError(f"{where}: an active row lies past the segment's last row ({total} rows)")
        return rows

    def finish(self) -> None:
        if self.at != self.head.size:
            raise DecodeError(f"{self.where}: {self.head.size - self.at} bytes left over in the row head stream")
        try:
            self.rice.finish()
        except DecodeError as exc:
            raise DecodeError(str(exc).replace("quotient stream", "row quotient stream")
                              .replace("remainder stream", "row remainder stream")) from None


# --- the encoding ----------------------------------------------------------------------------
NAME = "sparse-rows"


class SparseRows:
    """The active rows of a table (Rice-coded gaps), then ``sparse-exp2`` over their elements."""

    name, kind, core, reads_range, measures_lazily, min_dims = NAME, SPARSE, False, False, False, 2
    dtypes = tuple(exp2.EXP_FIELDS)

    def stream_lengths(self, width, segments, dtypes):
        inner = exp2.ENCODING.stream_lengths(width, segments, dtypes)
        # at most one active row per change (a row without one is not named)
        return inner + [(HEAD_BYTES * len(segments), True), (sum((s.count + 7) // 8 for s in segments), False),
                        (sum((31 * s.nnz + 7) // 8 for s in segments), False)]

    def stream_level(self, stream: int, level: int) -> int:
        return level

    def memory(self, block) -> int:
        # sparse-exp2's over the gathered elements (at most the range), plus the gathered copy, the
        # row spans (four int64 per active row, at most one per change) and the positions mapped back
        longest = max(s.count for s in block.segments)
        nnz = sum(s.nnz for s in block.segments)
        return exp2.ENCODING.memory(block) + (block.width + 1) * longest + 80 * nnz

    def on_device(self, old, pos, dtype: str, *, start: int, row: int):
        """The active rows, the gathered range and the changes' positions in it, with torch ops
        where the tensors live (only the active rows' elements cross to the host); None where the
        trial is skipped."""
        import torch  # torch: only on that path

        count = old.numel()
        if row < 2 or pos.numel() < MIN_CHANGES:
            return None
        off = start % row
        rows, which = torch.unique_consecutive(torch.div(pos + off, row, rounding_mode="floor"), return_inverse=True)
        if rows.numel() * row > MAX_ACTIVE * count:
            return None
        lo = (rows * row - off).clamp_(min=0)
        lens = ((rows + 1) * row - off).clamp_(max=count) - lo
        cum = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=pos.device)
        torch.cumsum(lens, 0, out=cum[1:])
        rid = torch.repeat_interleave(torch.arange(rows.numel(), device=pos.device), lens)
        idx = lo.index_select(0, rid) + torch.arange(rid.numel(), device=pos.device) - cum.index_select(0, rid)
        gathered = old.index_select(0, idx).cpu().numpy().view(UINT[old.element_size()])
        inner = cum.index_select(0, which) + pos - lo.index_select(0, which)
        return rows.cpu().numpy(), gathered, inner.cpu().numpy(), n_rows(start, count, row)

    def offer(self, r: RangeInput, best, stored, config):
        if r.row < 2 or r.z is None or r.nnz < MIN_CHANGES:
            return None
        if r.device is not None:  # the torch scan's (on_device)
            pieces = pack(r.device[1], r.device[2], r.z, r.dtype, r.device[0], r.device[3])
        elif r.old is None or r.pos is None:
            return None
        else:
            rows, which = _active(r.pos, r.start, r.row)
            if rows.size * r.row > MAX_ACTIVE * r.count:
                return None
            pieces = _build(r.old, r.pos, r.z, r.dtype, r.start, r.row, rows, which)
        return pieces if stored_bytes(self, pieces, config.zstd_level) < stored() else None

    def decode(self, streams: BlockStreams, d: DecodeInput) -> list[Op]:
        block = streams.block
        udt = UINT[block.width]
        inner, rows_in = readers([streams.stream(i) for i in range(len(block.streams))], block.width, d.where)
        ops: list[Op] = []
        for seg in block.segments:
            te = d.tensors[seg.tensor]
            t = d.base[seg.tensor] if seg.tensor < len(d.base) else None
            if t is None:
                raise DecodeError(f"{d.where}: {NAME} needs the base of {te.name}")
            if len(te.shape) < 2 or te.shape[-1] < 1:  # check_block refused the first; the second holds no element
                raise DecodeError(f"{d.where}: {NAME} segment on {te.name} of shape {list(te.shape)}: rows need "
                                  "a tensor of two or more dimensions")
            pos, z = read_segment(inner, rows_in, t[seg.start:seg.start + seg.count], seg.start, te.shape[-1],
                                  seg.nnz, te.dtype, udt)
            ops.append(Scatter(seg.tensor, pos + seg.start, unzigzag(z)))
        inner.finish()
        rows_in.finish()
        return ops


def readers(streams: list[np.ndarray], width: int, where: str) -> tuple[exp2.SegmentReader, _RowReader]:
    """The readers of a block's decoded streams: its ``sparse-exp2`` part and its rows."""
    return exp2.SegmentReader(streams[:exp2.N_STREAMS], width, where), _RowReader(streams, width, where)


def read_segment(inner: exp2.SegmentReader, rows_in: _RowReader, rng: np.ndarray, start: int, row: int, nnz: int,
                 dtype: str, udt) -> tuple[np.ndarray, np.ndarray]:
    """Relative positions (ascending) and wrapped differences of one segment's changes, checked:
    ``rng`` is the base of its range, ``start`` the range's first element in its tensor."""
    rows = rows_in.rows(n_rows(start, rng.size, row), nnz)
    lo, hi, cum = layout(start, rng.size, row, rows)
    pos, z = inner.segment(gather(rng, start, row, rows, lo, hi), nnz, dtype, udt)
    which = np.searchsorted(cum, pos, side="right") - 1
    if np.count_nonzero(which[1:] != which[:-1]) + 1 != rows.size:
        raise DecodeError(f"{inner.where}: an active row holds no change")
    return lo[which] + (pos - cum[which]), z


ENCODING = register(SparseRows())

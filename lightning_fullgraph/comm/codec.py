"""Row codec for compressed halo messages with a bit-width per row.

Composes :mod:`~lightning_fullgraph.comm.quantize` (pure per-row quantizer) into the byte
layout one ``all_to_all_single`` carries.  The rows for one peer are contiguous in the
send order; inside that peer's message the rows are grouped by bit-width (ascending), each
group a block of fixed-size quantizer records in the original row order::

    message to peer p = [records of p's 1-bit rows | 2-bit rows | 4-bit rows | 8-bit rows]

Sender and receiver both know every row's bit-width (the assignment is broadcast), so the
receiver computes the same layout without any header.  Only Python loops over peers x
bit-widths (at most ``4 W``), never over rows.

The layout of a message (:class:`MessageLayout`: rows per peer and bit-width, bytes per peer,
the rows of each width) depends only on the bit-widths, which change when a policy
re-assigns them, not every message: :class:`LayoutCache` keeps it per bit-width tensor, so a
training message costs no ``bincount``/``nonzero`` of its own (measured on tolokers, 4 ranks,
adaqp: the layout was ~6 % of a training step when computed per message).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fullgraph.comm.quantize import (
    SUPPORTED_BITS,
    dequantize,
    dequantize_scattered,
    from_bytes,
    quantize,
    quantize_scattered,
    row_nbytes,
    uses_kernels,
)

__all__ = [
    "EncodedRows",
    "LayoutCache",
    "MessageLayout",
    "ReceivedRows",
    "decode_rows",
    "decode_rows_add",
    "encode_rows",
    "message_layout",
    "message_nbytes",
]

BIT_CHOICES = SUPPORTED_BITS


def message_nbytes(bits: Tensor, counts: list[int], row_len: int) -> list[int]:
    """Bytes of the message to each peer. ``bits``: ``[sum(counts)]`` per-row bit-widths."""
    return message_layout(bits, counts, row_len).nbytes


@dataclass(frozen=True)
class MessageLayout:
    """Where every row of a message at per-row bit-widths lies (the module docstring's layout).

    Attributes:
        widths: ``{b: [rows of peer 0 at b, rows of peer 1 at b, ...]}`` for the widths used.
        nbytes: Bytes of the message to (or from) each peer.
        index: ``{b: [rows at b]}`` positions (int64) of the rows of each width in row order
            (not used when every row has the same width: no gather, no scatter).
        offsets: ``{b: [rows at b]}`` byte offsets (int64) of those rows' records in the
            message (all peers' messages back to back).
        payload_bits: ``sum(bits) * row_len``: bits of the levels, row metadata excluded.
    """

    widths: dict[int, list[int]]
    nbytes: list[int]
    index: dict[int, Tensor]
    offsets: dict[int, Tensor]
    payload_bits: int

    @property
    def single(self) -> int | None:
        """The one bit-width of every row, or ``None`` for mixed widths (or no rows)."""
        return next(iter(self.widths)) if len(self.widths) == 1 else None


def message_layout(bits: Tensor, counts: list[int], row_len: int) -> MessageLayout:
    """The :class:`MessageLayout` of ``sum(counts)`` rows of ``row_len`` values whose
    bit-widths are ``bits`` (``[sum(counts)]``), ``counts[p]`` rows for peer ``p``."""
    # the peer of every row, then per width its rows, their count per peer and their offsets
    peer = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    widths: dict[int, list[int]] = {}
    index: dict[int, Tensor] = {}
    owners: dict[int, Tensor] = {}
    for b in BIT_CHOICES:
        idx = (bits == b).nonzero().flatten()
        if idx.numel():
            index[b] = idx
            owners[b] = peer[idx.cpu()]
            widths[b] = torch.bincount(owners[b], minlength=len(counts)).tolist()
    # byte offset of every (peer, width) block: peers in order, widths ascending in each
    start: dict[int, list[int]] = {b: [0] * len(counts) for b in widths}
    nbytes = [0] * len(counts)
    at = 0
    for p in range(len(counts)):
        peer_start = at
        for b in widths:  # ascending, as BIT_CHOICES is
            start[b][p] = at
            at += widths[b][p] * row_nbytes(row_len, b)
        nbytes[p] = at - peer_start
    offsets: dict[int, Tensor] = {}
    for b, idx in index.items():
        per_peer = torch.tensor(widths[b], dtype=torch.long)
        first = torch.cumsum(per_peer, 0) - per_peer  # position of each peer's first row at b
        owner = owners[b]
        rank = torch.arange(idx.numel()) - first[owner]  # the row's place in its block
        offsets[b] = (torch.tensor(start[b], dtype=torch.long)[owner] + rank * row_nbytes(row_len, b)).to(bits.device)
    payload = sum(b * sum(per_peer) for b, per_peer in widths.items()) * row_len
    return MessageLayout(widths, nbytes, index, offsets, payload)


class LayoutCache:
    """Message layouts kept per bit-width tensor, so that a message whose widths did not change
    reuses its layout.

    An entry is keyed on the tensor's identity and version counter, the counts and the row
    length, and holds a weak reference to the tensor: a tensor modified in place, or a new
    tensor that reuses a dead one's ``id``, gets a new layout.  At most ``size`` entries (the
    oldest go first); a policy keeps a few per (layer, direction).
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._entries: dict[tuple[int, int, tuple[int, ...], int], tuple[weakref.ref, MessageLayout]] = {}

    def get(self, bits: Tensor, counts: list[int], row_len: int) -> MessageLayout:
        """The layout of ``bits``/``counts``/``row_len`` (:func:`message_layout`), cached."""
        key = (id(bits), bits._version, tuple(counts), row_len)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is bits:
            return entry[1]
        layout = message_layout(bits, counts, row_len)
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = (weakref.ref(bits), layout)
        return layout

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class EncodedRows:
    """A compressed all-to-all payload.

    Attributes:
        buffer: ``[sum(nbytes)]`` uint8, the messages to all peers back to back.
        nbytes: Bytes sent to each peer (the all-to-all split sizes).
        rng: ``[S]`` float32 per-row ``max - min`` in the original row order (used by the
            bit-width assignment's variance model): the rows' true range, not the slightly
            wider 16-bit grid the records carry (:mod:`~lightning_fullgraph.comm.quantize`).
    """

    buffer: Tensor
    nbytes: list[int]
    rng: Tensor


def encode_rows(
    rows: Tensor,
    bits: Tensor,
    counts: list[int],
    generator: torch.Generator | None = None,
    layout: MessageLayout | None = None,
    index: Tensor | None = None,
) -> EncodedRows:
    """Quantizes ``rows`` (``[S, F]``, peer-contiguous, ``counts[p]`` rows for peer ``p``) with
    ``bits[i]`` bits for row ``i``, into the layout of the module docstring (``layout``: that
    of ``bits``/``counts``, e.g. from a :class:`LayoutCache`; computed when ``None``).

    ``index``: ``[S]`` int64; the message's rows are then ``rows[index]`` (``rows``: ``[M, F]``,
    e.g. all rows a rank owns and its send index), the same bytes as
    ``encode_rows(rows.index_select(0, index), ...)``; the compiled CPU kernels read them where
    they lie (no ``[S, F]`` gather: on the 60k community graph gathering took as long as
    quantizing), other devices gather first."""
    if index is not None and not uses_kernels(rows.device):
        rows, index = rows.index_select(0, index), None
    if layout is None:
        layout = message_layout(bits, counts, rows.size(1))
    b = layout.single
    if b is not None and index is None:
        # One bit-width (sylvie, adaqp before its first assignment): the quantizer's records,
        # in row order, already are the peer-contiguous layout; no gather, no re-concatenation.
        q = quantize(rows, b, generator=generator)
        return EncodedRows(buffer=q.buffer.reshape(-1), nbytes=layout.nbytes, rng=q.rng)
    return _encode_grouped(rows, counts, layout, generator, index)


def _encode_grouped(
    rows: Tensor,
    counts: list[int],
    layout: MessageLayout,
    generator: torch.Generator | None,
    index: Tensor | None = None,
) -> EncodedRows:
    # every width's rows quantized in one call (one key), each record written where it goes
    buffer = torch.empty(sum(layout.nbytes), dtype=torch.uint8, device=rows.device)
    if layout.single is not None and index is not None:  # one call over the whole message
        b = layout.single
        return EncodedRows(buffer, layout.nbytes, quantize_scattered(rows, index, b, buffer, layout.offsets[b], generator))
    rng = torch.zeros(sum(counts), dtype=torch.float32, device=rows.device)
    for b in layout.widths:
        at = layout.index[b]  # the width's rows, as positions in the message
        src = at if index is None else index[at]
        rng.index_copy_(0, at, quantize_scattered(rows, src, b, buffer, layout.offsets[b], generator))
    return EncodedRows(buffer=buffer, nbytes=layout.nbytes, rng=rng)


def decode_rows(
    buffer: Tensor,
    bits: Tensor,
    counts: list[int],
    row_len: int,
    layout: MessageLayout | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Inverse of :func:`encode_rows` at the receiver: ``[R, row_len]`` float32 rows, where
    ``counts[q]`` rows came from peer ``q`` and ``bits`` (``[R]``) are their bit-widths.

    ``out``: a ``[R, row_len]`` float32 tensor to write the rows into (e.g. the halo rows of
    the buffer a conv reads), saving the allocation and the copy of a fresh tensor."""
    if layout is None:
        layout = message_layout(bits, counts, row_len)
    b = layout.single
    if b is not None:
        return dequantize(from_bytes(buffer.contiguous(), bits.numel(), row_len, b), out=out)
    return _decode_grouped(buffer, counts, row_len, layout, out)


def _decode_grouped(
    buffer: Tensor, counts: list[int], row_len: int, layout: MessageLayout, out: Tensor | None
) -> Tensor:
    n = sum(counts)
    if out is None:
        out = torch.empty((n, row_len), dtype=torch.float32, device=buffer.device)
    buffer = buffer.contiguous()
    for b in layout.widths:
        dequantize_scattered(buffer, layout.offsets[b], b, row_len, layout.index[b], out)
    return out


def decode_rows_add(
    buffer: Tensor,
    bits: Tensor,
    counts: list[int],
    row_len: int,
    target: Tensor,
    index: Tensor,
    layout: MessageLayout | None = None,
) -> Tensor:
    """Adds the rows :func:`decode_rows` gives into ``target`` (``[M, row_len]``), row ``i``
    into ``target[index[i]]`` (``index``: ``[R]`` int64, repeats allowed: those rows add up),
    in place; returns ``target``.

    The sums are ``target.index_add_`` of one bit-width's rows after the other (widths
    ascending, rows in message order within a width; with one width exactly
    ``target.index_add_(0, index, decode_rows(...))``).  The compiled CPU kernels add each
    decoded value where it goes, so the ``[R, row_len]`` rows are never written: on the
    receiving side of a gradient message that is one fresh tensor and two passes fewer than
    decoding first.  Other devices and dtypes decode first."""
    if layout is None:
        layout = message_layout(bits, counts, row_len)
    if target.dtype != torch.float32 or not uses_kernels(target.device):
        rows = decode_rows(buffer, bits, counts, row_len, layout)
        if layout.single is not None:
            return target.index_add_(0, index, rows.to(target.dtype))
        for b in layout.widths:
            at = layout.index[b]
            target.index_add_(0, index[at], rows[at].to(target.dtype))
        return target
    buffer = buffer.contiguous()
    for b in layout.widths:
        rows_at = index if layout.single is not None else index[layout.index[b]]
        dequantize_scattered(buffer, layout.offsets[b], b, row_len, rows_at, target, accumulate=True)
    return target


@dataclass
class ReceivedRows:
    """A received compressed message kept as its bytes, decoded only when used.

    Sylvie's pipeline keeps each layer's last halo block and gradient block for an epoch;
    kept encoded they take ``~(bits + 8 * META_NBYTES / F) / 32`` of the float32 rows'
    memory (1-bit rows of 128 values: 20 bytes instead of 512).  Decoding is deterministic,
    so :meth:`decode` returns exactly the rows :func:`decode_rows` gave at receipt.

    Attributes:
        buffer: ``[sum(nbytes)]`` uint8, the received messages back to back.
        bits: ``[R]`` bit-width of every received row.
        counts: Rows received from each peer.
        row_len: Values per row ``F``.
        dtype: dtype of the decoded rows (the sender's).
        stats: Optional object with a ``quant_time`` attribute that decoding time is added to.
        layout: The message's :class:`MessageLayout` (computed on decoding when ``None``).
    """

    buffer: Tensor
    bits: Tensor
    counts: list[int]
    row_len: int
    dtype: torch.dtype
    stats: Any = None
    layout: MessageLayout | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the decoded rows, ``(R, F)``."""
        return (self.bits.numel(), self.row_len)

    def decode(self, out: Tensor | None = None) -> Tensor:
        """The ``[R, F]`` rows: a new tensor on every call, or written into ``out`` (``[R, F]``
        of the rows' dtype, e.g. the halo rows of the buffer a conv reads) and returned."""
        t = time.perf_counter()
        direct = out if out is not None and self.dtype == torch.float32 else None
        rows = decode_rows(self.buffer, self.bits, self.counts, self.row_len, self.layout, direct).to(self.dtype)
        if out is not None and direct is None:
            rows = out.copy_(rows)
        if self.stats is not None:
            self.stats.quant_time += time.perf_counter() - t
        return rows

    def add_into(self, target: Tensor, index: Tensor) -> Tensor:
        """Adds the decoded rows into ``target`` (``[M, F]``), row ``i`` into
        ``target[index[i]]``, in place (:func:`decode_rows_add`: the halo-row gradients coming
        home to the rows their owner holds, without the ``[R, F]`` rows); returns ``target``."""
        t = time.perf_counter()
        decode_rows_add(self.buffer, self.bits, self.counts, self.row_len, target, index, self.layout)
        if self.stats is not None:
            self.stats.quant_time += time.perf_counter() - t
        return target

"""Row codec for compressed halo messages with a bit-width per row.

Composes :mod:`~lightning_fullgraph.comm.quantize` (pure per-row quantizer) into the byte
layout one ``all_to_all_single`` carries.  The rows for one peer are contiguous in the
send order; inside that peer's message the rows are grouped by bit-width (ascending), each
group a block of fixed-size quantizer records in the original row order::

    message to peer p = [records of p's 1-bit rows | 2-bit rows | 4-bit rows | 8-bit rows]

Sender and receiver both know every row's bit-width (the assignment is broadcast), so the
receiver computes the same layout without any header.  Only Python loops over peers x
bit-widths (at most ``4 W``), never over rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fullgraph.comm.quantize import SUPPORTED_BITS, dequantize, from_bytes, quantize, row_nbytes

__all__ = ["EncodedRows", "ReceivedRows", "decode_rows", "encode_rows", "message_nbytes"]

BIT_CHOICES = SUPPORTED_BITS


def _counts_by_bits(bits: Tensor, counts: list[int]) -> dict[int, list[int]]:
    """Rows of every (peer, bit-width): ``{b: [rows of peer 0 at b, rows of peer 1 at b, ...]}``."""
    peer = torch.repeat_interleave(
        torch.arange(len(counts), device=bits.device), torch.tensor(counts, device=bits.device)
    )
    out: dict[int, list[int]] = {}
    for b in BIT_CHOICES:
        mask = bits == b
        if bool(mask.any()):
            out[b] = torch.bincount(peer[mask], minlength=len(counts)).tolist()
    return out


def message_nbytes(bits: Tensor, counts: list[int], row_len: int) -> list[int]:
    """Bytes of the message to each peer. ``bits``: ``[sum(counts)]`` per-row bit-widths."""
    total = [0] * len(counts)
    for b, per_peer in _counts_by_bits(bits, counts).items():
        size = row_nbytes(row_len, b)
        for p, c in enumerate(per_peer):
            total[p] += c * size
    return total


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
    rows: Tensor, bits: Tensor, counts: list[int], generator: torch.Generator | None = None
) -> EncodedRows:
    """Quantizes ``rows`` (``[S, F]``, peer-contiguous, ``counts[p]`` rows for peer ``p``) with
    ``bits[i]`` bits for row ``i``, into the layout of the module docstring."""
    row_len = rows.size(1)
    by_bits = _counts_by_bits(bits, counts)
    if len(by_bits) == 1:
        # One bit-width (sylvie, adaqp before its first assignment): the quantizer's records,
        # in row order, already are the peer-contiguous layout; no gather, no re-concatenation.
        (b,) = by_bits
        q = quantize(rows, b, generator=generator)
        return EncodedRows(
            buffer=q.buffer.reshape(-1), nbytes=message_nbytes(bits, counts, row_len), rng=q.rng
        )
    return _encode_grouped(rows, bits, counts, by_bits, generator)


def _encode_grouped(
    rows: Tensor,
    bits: Tensor,
    counts: list[int],
    by_bits: dict[int, list[int]],
    generator: torch.Generator | None,
) -> EncodedRows:
    row_len = rows.size(1)
    records: dict[int, list[Tensor]] = {}
    rng = torch.zeros(rows.size(0), dtype=torch.float32, device=rows.device)
    for b, per_peer in by_bits.items():
        idx = (bits == b).nonzero().flatten()
        q = quantize(rows.index_select(0, idx), b, generator=generator)
        rng[idx] = q.rng
        records[b] = list(torch.split(q.buffer, per_peer))
    pieces = [records[b][p].reshape(-1) for p in range(len(counts)) for b in sorted(records)]
    buffer = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=rows.device)
    return EncodedRows(buffer=buffer, nbytes=message_nbytes(bits, counts, row_len), rng=rng)


def decode_rows(buffer: Tensor, bits: Tensor, counts: list[int], row_len: int) -> Tensor:
    """Inverse of :func:`encode_rows` at the receiver: ``[R, row_len]`` float32 rows, where
    ``counts[q]`` rows came from peer ``q`` and ``bits`` (``[R]``) are their bit-widths."""
    by_bits = _counts_by_bits(bits, counts)
    if len(by_bits) == 1:
        (b,) = by_bits
        return dequantize(from_bytes(buffer.contiguous(), bits.numel(), row_len, b))
    return _decode_grouped(buffer, bits, counts, row_len, by_bits)


def _decode_grouped(
    buffer: Tensor, bits: Tensor, counts: list[int], row_len: int, by_bits: dict[int, list[int]]
) -> Tensor:
    out = torch.empty((bits.numel(), row_len), dtype=torch.float32, device=buffer.device)
    per_bits: dict[int, list[Tensor]] = {b: [] for b in by_bits}
    offset = 0
    for p in range(len(counts)):
        for b in sorted(by_bits):
            n = by_bits[b][p] * row_nbytes(row_len, b)
            per_bits[b].append(buffer[offset : offset + n])
            offset += n
    for b, chunks in per_bits.items():
        idx = (bits == b).nonzero().flatten()
        flat = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        out[idx] = dequantize(from_bytes(flat.contiguous(), idx.numel(), row_len, b))
    return out


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
    """

    buffer: Tensor
    bits: Tensor
    counts: list[int]
    row_len: int
    dtype: torch.dtype
    stats: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the decoded rows, ``(R, F)``."""
        return (self.bits.numel(), self.row_len)

    def decode(self) -> Tensor:
        """The ``[R, F]`` rows (a new tensor on every call)."""
        t = time.perf_counter()
        out = decode_rows(self.buffer, self.bits, self.counts, self.row_len).to(self.dtype)
        if self.stats is not None:
            self.stats.quant_time += time.perf_counter() - t
        return out

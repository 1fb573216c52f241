"""Halo messages over the plain transport: rows as they are, or the codec composed around it.

:func:`send_rows` hands a message's rows to :meth:`HaloTransport.start
<lightning_fullgraph.comm.transport.HaloTransport.start>` as they are; :func:`send_encoded`
encodes them first (:func:`~lightning_fullgraph.comm.codec.encode_rows`, the per-row
bit-widths the caller's policy chose), moves the bytes, and returns a handle that decodes
after the wait -- the way torch's ``fp16_compress_wrapper`` wraps a plain all-reduce.  The
transport takes no callbacks: :func:`send_encoded` returns the rows' ranges and the caller
hands them to its policy.

Both count a layer's message in :class:`~lightning_fullgraph.comm.transport.CommStats`
(values, payload bits without row metadata, wire bits with it, per direction and per layer);
the transport counts bytes and collectives.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from lightning_fullgraph.comm.codec import ReceivedRows, decode_rows, encode_rows, message_nbytes
from lightning_fullgraph.comm.quantize import META_NBYTES
from lightning_fullgraph.comm.transport import CommStats, HaloTransport, Transfer

__all__ = ["EncodedTransfer", "Message", "send_encoded", "send_rows"]


class EncodedTransfer:
    """A compressed message in flight: :meth:`wait` decodes the rows, :meth:`received` keeps
    them encoded.  Call one of the two, once.

    Like :class:`~lightning_fullgraph.comm.transport.Transfer` it refers to nothing that
    refers back to it, so the received bytes die with the last reference.
    """

    __slots__ = ("_bits", "_counts", "_dtype", "_row_len", "_stats", "_transfer")

    def __init__(
        self, transfer: Transfer, bits: Tensor, counts: list[int], row_len: int, dtype: torch.dtype, stats: CommStats
    ) -> None:
        self._transfer = transfer
        self._bits = bits
        self._counts = counts
        self._row_len = row_len
        self._dtype = dtype
        self._stats = stats

    def wait(self) -> Tensor:
        """Waits and returns the decoded ``[sum(recv_counts), F]`` rows in the sender's dtype
        (decoding counted in ``quant_time``)."""
        buf = self._transfer.wait()
        t = time.perf_counter()
        out = decode_rows(buf, self._bits, self._counts, self._row_len).to(self._dtype)
        self._stats.quant_time += time.perf_counter() - t
        return out

    def received(self) -> ReceivedRows:
        """Waits and returns what arrived without decoding it, a
        :class:`~lightning_fullgraph.comm.codec.ReceivedRows` (for keeping it small)."""
        buf = self._transfer.wait()
        return ReceivedRows(buf, self._bits, self._counts, self._row_len, self._dtype, self._stats)


#: A message in flight: ``wait()`` gives the rows, ``received()`` the message as it arrived.
Message = Transfer | EncodedTransfer


def send_rows(
    transport: HaloTransport,
    rows: Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    *,
    kind: str = "message",
    layer: int | None = None,
    direction: str = "forward",
) -> Transfer:
    """Starts a message of ``rows`` (``[sum(send_counts), *]``, peer-contiguous) in their own
    dtype; a layer's message (``kind="message"``, ``layer`` given) counts its values at their
    dtype's bits."""
    transfer = transport.start(rows, send_counts, recv_counts, kind=kind)
    if kind == "message" and layer is not None:
        vbits = 8 * rows.element_size()
        n = rows.numel()
        transport.stats.record_message(layer, direction, n, n * vbits, n * vbits)
    return transfer


def send_encoded(
    transport: HaloTransport,
    rows: Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    bits: tuple[Tensor, Tensor],
    *,
    generator: torch.Generator | None = None,
    kind: str = "message",
    layer: int | None = None,
    direction: str = "forward",
) -> tuple[EncodedTransfer, Tensor]:
    """Encodes ``rows`` at per-row bit-widths, starts the transfer of the bytes, and returns
    ``(handle, row ranges)``.

    Args:
        rows: ``[sum(send_counts), F]`` rows, peer-contiguous (two-dimensional).
        bits: ``(bits of every sent row [S], bits of every received row [R])`` (uint8).
        generator: Random stream of the stochastic rounding.
        kind: The transfer's kind (:mod:`~lightning_fullgraph.comm.transport`).
        layer, direction: Which message this is (for the per-layer counters).

    Returns:
        The :class:`EncodedTransfer` and the ``[S]`` per-row ``max - min`` of the encoded rows
        (the statistics AdaQP's assignment reads; the caller hands them to its policy).
    """
    stats = transport.stats
    send_bits, recv_bits = bits
    row_len = rows.size(1)
    t0 = time.perf_counter()
    enc = encode_rows(rows.detach().float(), send_bits, send_counts, generator=generator)
    recv_nbytes = message_nbytes(recv_bits, recv_counts, row_len)
    stats.quant_time += time.perf_counter() - t0
    if layer is not None:
        payload = int(send_bits.sum()) * row_len
        stats.record_message(layer, direction, rows.numel(), payload, payload + 8 * META_NBYTES * rows.size(0))
    transfer = transport.start(enc.buffer, enc.nbytes, recv_nbytes, kind=kind)
    return EncodedTransfer(transfer, recv_bits, recv_counts, row_len, rows.dtype, stats), enc.rng

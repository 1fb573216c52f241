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

from lightning_fullgraph.comm.codec import LayoutCache, MessageLayout, ReceivedRows, decode_rows, encode_rows
from lightning_fullgraph.comm.quantize import META_NBYTES
from lightning_fullgraph.comm.transport import CommStats, HaloTransport, Transfer

__all__ = ["EncodedTransfer", "Message", "send_encoded", "send_rows"]


class EncodedTransfer:
    """A compressed message in flight: :meth:`wait` decodes the rows, :meth:`received` keeps
    them encoded (e.g. to be added up where they go, ``ReceivedRows.add_into``).  Call one of
    the two, once.

    Like :class:`~lightning_fullgraph.comm.transport.Transfer` it refers to nothing that
    refers back to it, so the received bytes die with the last reference.
    """

    __slots__ = ("_bits", "_counts", "_dtype", "_layout", "_out", "_row_len", "_stats", "_transfer")

    def __init__(
        self,
        transfer: Transfer,
        bits: Tensor,
        counts: list[int],
        row_len: int,
        dtype: torch.dtype,
        stats: CommStats,
        layout: MessageLayout | None = None,
        out: Tensor | None = None,
    ) -> None:
        self._transfer = transfer
        self._bits = bits
        self._counts = counts
        self._row_len = row_len
        self._dtype = dtype
        self._stats = stats
        self._layout = layout
        self._out = out

    def wait(self) -> Tensor:
        """Waits and returns the decoded ``[sum(recv_counts), F]`` rows in the sender's dtype
        (decoding counted in ``quant_time``): decoded straight into the ``out`` rows given to
        :func:`send_encoded` when there are (float32 rows of a float32 message)."""
        buf = self._transfer.wait()
        t = time.perf_counter()
        out = self._out if self._dtype == torch.float32 else None
        rows = decode_rows(buf, self._bits, self._counts, self._row_len, self._layout, out).to(self._dtype)
        if self._out is not None and out is None:
            rows = self._out.copy_(rows)
        self._stats.quant_time += time.perf_counter() - t
        return rows

    def received(self) -> ReceivedRows:
        """Waits and returns what arrived without decoding it, a
        :class:`~lightning_fullgraph.comm.codec.ReceivedRows` (for keeping it small)."""
        buf = self._transfer.wait()
        return ReceivedRows(buf, self._bits, self._counts, self._row_len, self._dtype, self._stats, self._layout)


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
    out: Tensor | None = None,
) -> Transfer:
    """Starts a message of ``rows`` (``[sum(send_counts), *]``, peer-contiguous) in their own
    dtype, received into ``out`` when given (:meth:`HaloTransport.start
    <lightning_fullgraph.comm.transport.HaloTransport.start>`); a layer's message
    (``kind="message"``, ``layer`` given) counts its values at their dtype's bits."""
    transfer = transport.start(rows, send_counts, recv_counts, kind=kind, out=out)
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
    layouts: LayoutCache | None = None,
    out: Tensor | None = None,
    index: Tensor | None = None,
) -> tuple[EncodedTransfer, Tensor]:
    """Encodes ``rows`` at per-row bit-widths, starts the transfer of the bytes, and returns
    ``(handle, row ranges)``.

    Args:
        rows: ``[sum(send_counts), F]`` rows, peer-contiguous (two-dimensional); with
            ``index``, ``[M, F]`` rows of which the message carries ``rows[index]``.
        bits: ``(bits of every sent row [S], bits of every received row [R])`` (uint8).
        generator: Random stream of the stochastic rounding.
        kind: The transfer's kind (:mod:`~lightning_fullgraph.comm.transport`).
        layer, direction: Which message this is (for the per-layer counters).
        layouts: Where the two messages' layouts are kept between calls (computed per call
            when ``None``).
        out: ``[sum(recv_counts), F]`` rows of ``rows``' dtype the received rows are decoded
            into (e.g. the halo rows of the buffer the conv reads); a new tensor when ``None``.
        index: ``[sum(send_counts)]`` int64 rows of ``rows`` to send, read where they lie by
            the codec (:func:`~lightning_fullgraph.comm.codec.encode_rows`): the sender's
            ``index_select`` saved.

    Returns:
        The :class:`EncodedTransfer` and the ``[S]`` per-row ``max - min`` of the encoded rows
        (the statistics AdaQP's assignment reads; the caller hands them to its policy).
    """
    stats = transport.stats
    send_bits, recv_bits = bits
    row_len = rows.size(1)
    sent = rows.size(0) if index is None else index.numel()
    t0 = time.perf_counter()
    cache = layouts if layouts is not None else LayoutCache(2)
    send_layout = cache.get(send_bits, send_counts, row_len)
    recv_layout = cache.get(recv_bits, recv_counts, row_len)
    enc = encode_rows(
        rows.detach().float(), send_bits, send_counts, generator=generator, layout=send_layout, index=index
    )
    stats.quant_time += time.perf_counter() - t0
    if layer is not None:
        payload = send_layout.payload_bits
        stats.record_message(layer, direction, sent * row_len, payload, payload + 8 * META_NBYTES * sent)
    transfer = transport.start(enc.buffer, enc.nbytes, recv_layout.nbytes, kind=kind)
    handle = EncodedTransfer(transfer, recv_bits, recv_counts, row_len, rows.dtype, stats, recv_layout, out)
    return handle, enc.rng

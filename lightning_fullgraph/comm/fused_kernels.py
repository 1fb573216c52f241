r"""One-pass CPU kernels of the quantizer, compiled by numba: the same bytes as the torch path.

:mod:`~lightning_fullgraph.comm.quantize` defines the quantizer, its wire format and its dither;
this module is a second implementation of the common case for CPU tensors, compiled by numba
(``numba.njit``; a well-kept JIT library, nothing compiled at install), imported only when
:mod:`~lightning_fullgraph.comm.quantize` first needs it.  Each kernel makes one pass per row
while the row is in the L1 cache:

* :func:`quantize_gather` -- row min/max, the 16-bit grid, the fixed-point scale, the
  counter-based dither, stochastic rounding, packing and the record's metadata;
* :func:`dequantize_scatter` -- the record's grid, unpacking and ``lo + level * step`` straight
  into the output rows (e.g. the halo rows of the buffer a conv reads), or added into them (the
  halo-row gradients coming home to the rows their owner holds).

Both read (write) rows at given positions and records at given byte offsets: a whole message
in row order, or the rows of one bit-width of a mixed-width message where they lie, so the
codec needs no gather, scatter or concatenation of its own.  (One body per direction, each a
single loop nest: split into per-row helper functions the same code ran 15-20 % slower.)

Every floating-point operation is the torch path's, in the same order and precision (float32,
no fused multiply-add: numba compiles without ``fastmath``), and the dither is the same
function of (key, element index) (:func:`~lightning_fullgraph.comm.quantize.dither_hash`), so
both paths give the same bytes and the same rows, which ``tests/unit/test_fused_kernels.py``
checks byte for byte.  Rows the kernels do not cover are reported, and the caller then runs the
torch path on the whole call: non-finite values, grids beyond +-3.396e38 and ranges whose
float32 scale overflows (quantize), constant rows sent in their exact form and subnormal steps
(dequantize).

Minimum and maximum are taken on the order-preserving integer image of the floats
(``k = b ^ ((b >> 31) & 0x7FFFFFFF)`` for bit pattern ``b``), which vectorizes without
``fastmath``; NaN patterns land beyond +-inf there and are reported with the non-finite rows.
A zero minimum or maximum is made ``+0.0`` (both paths), so that rows holding both ``-0.0`` and
``0.0`` get one record.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["dequantize_scatter", "quantize_gather"]

_GRID_MAX = np.float32(2.0**128 - 2.0**119)
_TINY32 = np.float32(np.finfo(np.float32).tiny)
_CONST_MARK = 0xFF00


@numba.njit(
    "int64(float32[:, ::1], int64[::1], uint8[::1], int64[::1], float32[::1], float32[::1], uint32, int64)",
    cache=True, nogil=True, boundscheck=False,
)
def quantize_gather(x, index, flat, offsets, mn_out, rng_out, key, bits):  # pragma: no cover - compiled
    """Quantizes the rows ``x[index]`` (row ``i`` of the call is ``x[index[i]]``) and writes
    record ``i`` to ``flat[offsets[i] : offsets[i] + 4 + ceil(D b / 8)]``.

    Args:
        x: ``[M, D]`` float32, C-contiguous, ``D >= 1``.
        index: ``[N]`` int64 rows of ``x``.
        flat: 1-D uint8, the message (or the span of a record buffer).
        offsets: ``[N]`` int64 byte offsets of the records in ``flat``.
        mn_out, rng_out: ``[N]`` float32: the true row minimum and ``max - min``.
        key: the call's dither key (uint32).
        bits: 1, 2, 4 or 8.

    Returns:
        ``-1``, or the first row the kernel does not cover (the caller then runs the torch path
        on the whole call; ``flat`` is then partly written).
    """
    d = x.shape[1]
    xi = x.view(np.int32)
    levels = (1 << bits) - 1
    nbytes = (d * bits + 7) // 8
    rec = 4 + nbytes
    lim = np.float32(levels * 65536)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    scratch = np.empty(4, np.float32)
    sbits = scratch.view(np.int32)
    lv = np.zeros(nbytes * 8, np.uint8)  # a row's levels, one per byte (padding levels stay 0)
    w64 = lv.view(np.uint64)
    w32 = lv[: nbytes * 4].view(np.uint32)
    w16 = lv[: nbytes * 2].view(np.uint16)
    for i in range(index.shape[0]):
        row = x[index[i]]
        ri = xi[index[i]]
        kmin = np.int32(0x7FFFFFFF)
        kmax = np.int32(-0x80000000)
        for j in range(d):
            v = ri[j]
            k = v ^ ((v >> 31) & np.int32(0x7FFFFFFF))
            kmin = min(kmin, k)
            kmax = max(kmax, k)
        sbits[0] = kmin ^ ((kmin >> 31) & np.int32(0x7FFFFFFF))
        sbits[1] = kmax ^ ((kmax >> 31) & np.int32(0x7FFFFFFF))
        mn = scratch[0] + zero  # -0.0 -> +0.0
        mx = scratch[1] + zero
        if not (np.isfinite(mn) and np.isfinite(mx)):
            return i
        mn_out[i] = mn
        rng_out[i] = mx - mn
        # the 16-bit grid (quantize._grid): lo rounded toward -inf to bfloat16
        scratch[0] = mn
        b = sbits[0]
        sbits[0] = (((b >> 31) & np.int32(0xFFFF)) + b) & np.int32(-65536)
        lo = scratch[0]
        lob = sbits[0]
        s = np.float32(mx - lo)
        bp = np.float32(s - mx)
        err = np.float32(np.float32(mx - np.float32(s - bp)) - np.float32(bp + lo))
        scratch[1] = s
        scratch[2] = err
        rb = sbits[1] + (np.int32(1) if sbits[2] > 0 else np.int32(0))
        rb = (rb + np.int32(0x7FFF)) & np.int32(-32768)
        sbits[3] = rb
        r = scratch[3]
        sc = np.float32(one / r) * lim if r > zero else np.float32(np.inf)
        check = max(np.float32(lo + r), -lo)
        scaled = np.float32(r * sc)
        if scaled == scaled:  # fmax: a NaN (r = 0) is ignored
            check = max(check, scaled)
        if not check <= _GRID_MAX:
            return i
        if not np.isfinite(sc):
            sc = zero  # r = 0: every element is lo
        rowkey = np.uint32((i * d) & 0xFFFFFFFF)
        for j in range(d):
            t = np.float32(np.float32(row[j] - lo) * sc)
            t = t if t < lim else lim
            h = np.uint32(np.uint32(rowkey + np.uint32(j)) ^ key)
            h = h ^ (h >> np.uint32(16))
            h = np.uint32(h * np.uint32(0x7FEB352D))
            h = h ^ (h >> np.uint32(15))
            h = np.uint32(h * np.uint32(0x846CA68B))
            lv[j] = np.uint8((np.int32(t) + np.int32(h >> np.uint32(16))) >> 16)
        o = flat[offsets[i] : offsets[i] + rec]
        word = ((rb >> 15) << 16) | ((lob >> 16) & np.int32(0xFFFF))
        o[0] = np.uint8(word & 0xFF)
        o[1] = np.uint8((word >> 8) & 0xFF)
        o[2] = np.uint8((word >> 16) & 0xFF)
        o[3] = np.uint8((word >> 24) & 0xFF)
        if bits == 8:
            for k in range(nbytes):
                o[4 + k] = lv[k]
        elif bits == 4:
            for k in range(nbytes):
                wv = w16[k]
                o[4 + k] = np.uint8(((wv >> np.uint16(4)) | wv) & np.uint16(0xFF))
        elif bits == 2:
            for k in range(nbytes):
                o[4 + k] = np.uint8((np.uint32(w32[k] * np.uint32(0x01041040)) >> np.uint32(24)) & np.uint32(0xFF))
        else:
            for k in range(nbytes):
                o[4 + k] = np.uint8(np.uint64(w64[k] * np.uint64(0x0102040810204080)) >> np.uint64(56))
    return -1


@numba.njit(
    [
        "int64(uint8[::1], int64[::1], int64, int64, int64[::1], float32[:, ::1], boolean)",
        "int64(uint8[::1], int64[::1], int64, int64, int64[::1], float32[:, :], boolean)",
    ],
    cache=True, nogil=True, boundscheck=False,
)
def dequantize_scatter(flat, offsets, bits, d, index, out, accumulate):  # pragma: no cover - compiled
    """Decodes the records at ``flat[offsets[i]:]`` (``bits`` bits, ``d`` values) into the rows
    ``out[index[i]]`` (float32; contiguous rows take the vectorized specialization), or with
    ``accumulate`` adds them there, in record order (``index`` may repeat a row: the halo-row
    gradients that come home to one owned row; each sum is the float32 ``out + row`` that
    ``torch.index_add_`` forms).  Returns ``-1``, or the first record the kernel does not cover
    (an exact constant row or a subnormal step: the caller runs the torch path, on the whole
    call when writing, from that record on when accumulating)."""
    nbytes = (d * bits + 7) // 8
    rec = 4 + nbytes
    levels = (1 << bits) - 1
    flevels = np.float32(levels)
    zero = np.float32(0.0)
    scratch = np.empty(2, np.float32)
    sbits = scratch.view(np.int32)
    lv = np.zeros(nbytes * 8, np.uint8)  # the row's levels, one per byte
    w64 = lv.view(np.uint64)
    w32 = lv[: nbytes * 4].view(np.uint32)
    w16 = lv[: nbytes * 2].view(np.uint16)
    for i in range(index.shape[0]):
        rec_i = flat[offsets[i] : offsets[i] + rec]
        word = np.int32(rec_i[0]) | (np.int32(rec_i[1]) << 8) | (np.int32(rec_i[2]) << 16) | (np.int32(rec_i[3]) << 24)
        r16 = (word >> 16) & np.int32(0xFFFF)
        if r16 >= _CONST_MARK and nbytes > 0:
            return i
        sbits[0] = word << 16
        sbits[1] = r16 << 15
        lo = scratch[0]
        step = np.float32(scratch[1] / flevels)
        if step < _TINY32 and step > zero:
            return i
        o = out[index[i]]
        if bits == 8:
            if accumulate:
                for j in range(d):
                    o[j] += np.float32(np.float32(rec_i[4 + j]) * step) + lo
            else:
                for j in range(d):
                    o[j] = np.float32(np.float32(rec_i[4 + j]) * step) + lo
            continue
        # unpack word by word (quantize._unpack_into's multiplies), then one float loop
        if bits == 1:
            for k in range(nbytes):
                w = np.uint64(rec_i[4 + k])
                top = (w & np.uint64(0x80)) << np.uint64(49)
                w = np.uint64((w & np.uint64(0x7F)) * np.uint64(0x0002040810204081))
                w64[k] = (w & np.uint64(0x0101010101010101)) | top
        elif bits == 2:
            for k in range(nbytes):
                w = np.uint32(rec_i[4 + k])
                hi = np.uint32((w & np.uint32(0xCC)) * np.uint32((1 << 6) | (1 << 18)))
                w = np.uint32((w & np.uint32(0x33)) * np.uint32(1 | (1 << 12)))
                w32[k] = (w | hi) & np.uint32(0x03030303)
        else:
            for k in range(nbytes):
                w = np.uint16(rec_i[4 + k])
                w16[k] = (w | np.uint16(w << np.uint16(4))) & np.uint16(0x0F0F)
        if accumulate:
            for j in range(d):
                o[j] += np.float32(np.float32(lv[j]) * step) + lo
        else:
            for j in range(d):
                o[j] = np.float32(np.float32(lv[j]) * step) + lo
    return -1

r"""Per-row stochastic quantization of halo rows (AdaQP, Sylvie), fast on CPU and GPU.

Quantizer
---------
Every row ``x`` (length ``D``) of a ``[N, D]`` message is quantized on its own, asymmetrically,
to ``b`` bits (``b`` in {1, 2, 4, 8}), with ``L = 2^b - 1`` levels above the minimum::

    mn = min(x),  rng = max(x) - mn,  step = rng / L
    t_j = (x_j - mn) / step                       in [0, L]   (position in level units)
    q_j = floor(t_j + u_j),  u_j ~ U[0, 1)        in {0, .., L} (stochastic rounding)
    x^_j = mn + q_j * step                        (dequantized value)

``q_j`` is ``floor(t_j)`` or ``floor(t_j) + 1``, the latter with probability ``frac(t_j)``, so
``E[q_j] = t_j`` and ``E[x^_j] = x_j``: the quantizer is *unbiased*.  Its error has variance

    Var[x^_j] = frac(t_j) (1 - frac(t_j)) step^2 = (x_j - lo_j)(hi_j - x_j)

where ``lo_j <= x_j <= hi_j`` are the two levels around ``x_j``.  Per row (errors of different
elements are independent) the expected squared error is the sum over ``j`` of that product
(:func:`row_variance`).  It never exceeds ``D rng^2 / (4 L^2)`` (:func:`variance_bound`, each
term is at most ``step^2 / 4``); AdaQP's planning model ``D rng^2 / (6 L^2)``
(:func:`adaqp_variance_model`) is its average when the fractional parts are uniform
(``E[u(1 - u)] = 1/6``).  With ``b = 1`` (Sylvie) every element becomes ``mn`` or ``mx``.

Exact unbiasedness in fixed point
---------------------------------
Drawing a float ``u`` per element costs more than the whole rest of the quantizer, so the
dither is an integer.  ``t`` is scaled to fixed point with ``K = 16`` fractional bits,
``T = floor(t 2^K)`` (an ``int32``, ``0 <= T <= L 2^K``), and with ``r`` uniform on
``{0, .., 2^K - 1}`` (16 random bits, four per 64-bit draw of the generator)::

    q = (T + r) >> K

is ``floor(T / 2^K)`` plus one exactly when ``r >= 2^K - (T mod 2^K)``, which has probability
``(T mod 2^K) / 2^K``.  So ``E[q] = T / 2^K`` *exactly*: the rounding is exactly unbiased for the
fixed-point input, and the only bias with respect to ``t`` is the truncation
``0 <= t - T / 2^K < 2^-16`` level -- at 8 bits (``t`` up to 255) that is the size of the
float32 rounding error of ``t`` itself, and at any width it is below one part in 65536 of a
quantization step, far below the noise the rounding adds (standard deviation up to half a
step).  ``T <= L 2^K`` (enforced by a clamp that also absorbs float error) gives
``q <= L``: there is no ``u -> 1`` overflow into the next packed value.  The exact variance of
the fixed-point rounding is ``f (1 - f) step^2`` with ``f = frac(T / 2^K)``, which differs from
:func:`row_variance` by less than ``2^-16 step^2`` per element.

Wire format (one ``uint8`` buffer, one fixed-size record per row)
------------------------------------------------------------------
Every row becomes a record of :func:`row_nbytes` ``= 8 + ceil(D b / 8)`` bytes::

    [ mn: float32 | rng: float32 | packed levels: ceil(D b / 8) bytes ]

so a message of ``N`` rows is a contiguous ``[N, row_nbytes]`` uint8 tensor of exactly
:func:`payload_nbytes` ``= N * row_nbytes`` bytes.  Because records have a fixed size, the rows a
transport sends to different ranks are contiguous byte ranges (split sizes = rows x
``row_nbytes``), and a receiver can rebuild any slice of rows.

* Levels: ``8 / b`` levels per byte, element ``j`` of a row in byte ``j // (8 / b)`` at bit
  offset ``b * (j % (8 / b))`` (least-significant field first, like
  ``numpy.packbits(bitorder="little")`` for ``b = 1``).  Each row is padded with zero levels to
  a multiple of ``8 / b`` elements, at most 7 bits per row.
* Metadata: ``mn`` and ``rng = mx - mn`` as little-endian **float32**, 8 bytes per row.
  float32 is exact for ``mn`` (an input value), keeps the top level within one float32
  rounding of ``mx``, and never overflows or flushes where the data did not.  Half-precision
  metadata would save 4 bytes per row but costs accuracy or needs guards: bf16 (8 significant
  bits) moves ``mn`` by up to ``2^-9 |mn|`` -- more than the whole range for rows far from zero
  -- and ``rng`` by up to 0.2%; fp16 overflows beyond 65504 and loses ranges below ~6e-8.
  Cost of float32: 8 bytes on top of the 32 bytes of a 1-bit x 256 row (25%), of 256 bytes at
  8 bits (3%).
* Little-endian byte order of the host/device is assumed (every platform PyTorch supports).

Speed
-----
Rows are processed in chunks of ~2^18 elements that stay in the CPU cache; every step is a
vectorized in-place torch kernel on buffers allocated once per call (no Python loop over rows
or elements, no per-chunk temporaries); row min/max are taken chunk by chunk so the input is
read from memory once; packing/unpacking use word-level integer tricks (one multiply and one
shift pack 8 one-bit levels).  ``quantize`` rejects NaN/inf input with the per-row min/max it
needs anyway.  Drawing the 16-bit dither (``random_`` on int64, four dithers per draw) is about
half of the quantizer's time.  Large CPU outputs get ``MADV_HUGEPAGE`` advice
(:data:`HUGEPAGE_ADVICE`): first-touch page faults of a fresh 100 MB tensor otherwise cost more
than the dequantization itself.  Measured on one thread of the 2-core development machine
(100k x 256 float32, ``benchmarks/quantizer_speed.py``): quantize+pack ~1.0-1.7 GB/s of
float32 input, unpack+dequantize ~2.4-5 GB/s (4-6 GB/s into a reused ``out``), against
~0.1-0.2 / ~0.3-0.5 GB/s for a naive torch implementation.  The same code runs unchanged on
CUDA (in larger chunks).  Packing multiplies integers that wrap around (two's complement), as
every PyTorch backend does; the layout tests check every byte pattern.

Shapes: input ``[N, D]`` (two dimensions only; ``N`` or ``D`` may be 0); any floating dtype
(computed in float32, so values beyond float32 range are rejected as non-finite).  Output of
:func:`dequantize`: ``[N, D]`` float32.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DITHER_BITS",
    "HUGEPAGE_ADVICE",
    "META_NBYTES",
    "SUPPORTED_BITS",
    "QuantizedRows",
    "adaqp_variance_model",
    "dequantize",
    "from_bytes",
    "packed_row_nbytes",
    "payload_nbytes",
    "quantize",
    "row_nbytes",
    "row_variance",
    "variance_bound",
]

SUPPORTED_BITS: tuple[int, ...] = (1, 2, 4, 8)
#: Bytes of per-row metadata: float32 ``mn`` + float32 ``rng``.
META_NBYTES: int = 8
#: Fractional bits of the fixed-point dither (see the module docstring).
DITHER_BITS: int = 16

_ONE = 1 << DITHER_BITS
# Elements per chunk: ~1 MiB of float32 work buffer on CPU keeps the pipeline in L2/L3 while
# amortising the per-op dispatch cost; on accelerators larger chunks only bound the workspace.
_CPU_CHUNK_ELEMS = 1 << 18
_DEVICE_CHUNK_ELEMS = 1 << 24
_TINY32 = torch.finfo(torch.float32).tiny

# Word dtype whose bytes hold the 8/b levels that make up one packed byte.
_WORD_DTYPE = {1: torch.int64, 2: torch.int32, 4: torch.int16}
# Packing: the level in byte i of a word moves to bit (top + b*i) with one multiply.
_PACK_MUL = {1: 0x0102040810204080, 2: (1 << 24) | (1 << 18) | (1 << 12) | (1 << 6)}
_PACK_SHIFT = {1: 56, 2: 24}


def _check_bits(bits: int) -> int:
    try:
        value = None if isinstance(bits, bool) else operator.index(bits)  # int, numpy/torch ints
    except TypeError:
        value = None
    if value not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return value


def packed_row_nbytes(row_len: int, bits: int) -> int:
    """Bytes of packed levels per row: ``ceil(row_len * bits / 8)`` (metadata excluded)."""
    bits = _check_bits(bits)
    if row_len < 0:
        raise ValueError(f"row_len must be >= 0, got {row_len}")
    return -(-row_len * bits // 8)


def row_nbytes(row_len: int, bits: int) -> int:
    """Bytes of one row's record on the wire: ``META_NBYTES + packed_row_nbytes``."""
    return META_NBYTES + packed_row_nbytes(row_len, bits)


def payload_nbytes(num_rows: int, row_len: int, bits: int) -> int:
    """Exact size in bytes of the message for ``num_rows`` rows of ``row_len`` elements.

    ``num_rows * (8 + ceil(row_len * bits / 8))``: packed levels *and* float32 metadata, i.e.
    ``QuantizedRows.to_bytes().numel()``.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return num_rows * row_nbytes(row_len, bits)


def _chunk_rows(num_rows: int, row_len: int, device: torch.device) -> int:
    elems = _CPU_CHUNK_ELEMS if device.type == "cpu" else _DEVICE_CHUNK_ELEMS
    return max(1, min(num_rows, elems // max(row_len, 1)))


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """A quantized ``[N, D]`` message, stored as its wire records.

    Attributes:
        buffer: ``[N, row_nbytes(D, bits)]`` uint8, one record per row (module docstring).
        bits: Bits per element, one of 1, 2, 4, 8.
        shape: ``(N, D)`` of the original tensor.

    ``packed`` (``[N, ceil(D b / 8)]`` uint8, a strided view), ``mn`` and ``rng`` (``[N]``
    float32 copies) are read from the records.
    """

    buffer: Tensor
    bits: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        n, d = self.shape
        if self.buffer.dtype != torch.uint8 or tuple(self.buffer.shape) != (n, row_nbytes(d, self.bits)):
            raise ValueError(
                f"buffer must be uint8 of shape {(n, row_nbytes(d, self.bits))}, "
                f"got {self.buffer.dtype} {tuple(self.buffer.shape)}"
            )

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def row_len(self) -> int:
        return self.shape[1]

    @property
    def packed(self) -> Tensor:
        """Packed levels, ``[N, ceil(D b / 8)]`` uint8 (a view into :attr:`buffer`)."""
        return self.buffer[:, META_NBYTES:]

    def _meta(self, i: int) -> Tensor:
        n = self.shape[0]
        raw = torch.empty((n, 4), dtype=torch.uint8, device=self.buffer.device)
        raw.copy_(self.buffer[:, 4 * i : 4 * i + 4])  # a fresh, aligned copy
        return raw.view(torch.float32).view(n)

    @property
    def mn(self) -> Tensor:
        """Per-row minimum, ``[N]`` float32."""
        return self._meta(0)

    @property
    def rng(self) -> Tensor:
        """Per-row range ``max - min``, ``[N]`` float32 (0 for constant rows)."""
        return self._meta(1)

    @property
    def nbytes(self) -> int:
        """Size of :meth:`to_bytes`, equal to ``payload_nbytes(N, D, bits)``."""
        return payload_nbytes(self.shape[0], self.shape[1], self.bits)

    def to_bytes(self) -> Tensor:
        """The message as ONE contiguous 1-D uint8 tensor (no copy if already contiguous)."""
        return self.buffer.reshape(-1)

    @classmethod
    def from_bytes(cls, buf: Tensor, num_rows: int, row_len: int, bits: int) -> QuantizedRows:
        """Rebuilds a message from :meth:`to_bytes` output (or any uint8 tensor of its bytes).

        Args:
            buf: uint8 tensor with exactly ``payload_nbytes(num_rows, row_len, bits)`` elements.
            num_rows, row_len, bits: Shape and width of the quantized ``[num_rows, row_len]``.

        Returns:
            A :class:`QuantizedRows` viewing ``buf`` (no copy when ``buf`` is contiguous).
        """
        bits = _check_bits(bits)
        if buf.dtype != torch.uint8:
            raise ValueError(f"expected a uint8 buffer, got {buf.dtype}")
        expected = payload_nbytes(num_rows, row_len, bits)
        if buf.numel() != expected:
            raise ValueError(
                f"buffer has {buf.numel()} bytes, a {num_rows} x {row_len} message at {bits} bits "
                f"has {expected}"
            )
        return cls(buf.reshape(num_rows, row_nbytes(row_len, bits)), bits, (int(num_rows), int(row_len)))


def from_bytes(buf: Tensor, num_rows: int, row_len: int, bits: int) -> QuantizedRows:
    """Alias of :meth:`QuantizedRows.from_bytes`."""
    return QuantizedRows.from_bytes(buf, num_rows, row_len, bits)


def _as_2d_float(x: Tensor, what: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D [rows, features], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {x.dtype}")
    x = x.detach()
    return x if x.dtype == torch.float32 else x.float()


def _raise_non_finite(mn: Tensor, mx: Tensor, row0: int = 0) -> None:
    ok = torch.isfinite(mn) & torch.isfinite(mx)
    if not bool(ok.all()):
        row = row0 + int(torch.nonzero(~ok)[0])
        raise ValueError(f"cannot quantize non-finite values (NaN or inf), first in row {row}")
    bad = ~torch.isfinite(mx - mn)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"row {row0 + i} has a range max - min that overflows float32 "
            f"(min {float(mn[i]):.3g}, max {float(mx[i]):.3g})"
        )


def _row_min_max(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row ``mn``, ``mx``, ``rng`` of a non-empty float32 ``x``; raises on NaN/inf."""
    mn = torch.amin(x, dim=1)
    mx = torch.amax(x, dim=1)
    rng = mx - mn  # NaN or inf whenever mn or mx is (amin/amax propagate NaN)
    if not bool(torch.isfinite(rng).all()):
        _raise_non_finite(mn, mx)
    return mn, mx, rng


# Hugepage advice for large CPU outputs: first-touch page faults of a fresh 100 MB tensor cost
# more than the whole dequantization on small VMs; MADV_HUGEPAGE cuts them ~500x in number.
HUGEPAGE_ADVICE: bool = True
_HUGEPAGE_MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_madvise = None


def _advise_hugepages(t: Tensor) -> None:
    global _madvise, HUGEPAGE_ADVICE
    try:
        if _madvise is None:
            import ctypes
            import sys

            if not sys.platform.startswith("linux"):
                HUGEPAGE_ADVICE = False
                return
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        ptr = t.data_ptr()
        lo = -(-ptr // _HUGE) * _HUGE
        hi = (ptr + t.numel() * t.element_size()) // _HUGE * _HUGE
        if hi > lo:
            _madvise(lo, hi - lo, 14)  # MADV_HUGEPAGE; a hint, failure is harmless
    except Exception:  # pragma: no cover - platform without libc/madvise
        HUGEPAGE_ADVICE = False


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if HUGEPAGE_ADVICE and device.type == "cpu" and t.numel() * t.element_size() >= _HUGEPAGE_MIN_BYTES:
        _advise_hugepages(t)
    return t


_U16_OK: dict[str, bool] = {}


def _uint16_copy_ok(device: torch.device) -> bool:
    """Whether ``uint16 -> int32`` copies work on this device type (bare-bones dtype)."""
    ok = _U16_OK.get(device.type)
    if ok is None:
        try:
            src = torch.tensor([-1, 7], dtype=torch.int16, device=device).view(torch.uint16)
            dst = torch.empty(2, dtype=torch.int32, device=device).copy_(src)
            ok = dst.tolist() == [65535, 7]
        except Exception:  # pragma: no cover - depends on the torch build
            ok = False
        _U16_OK[device.type] = ok
    return ok


def quantize(
    x: Tensor, bits: int, generator: torch.Generator | None = None, *, out: Tensor | None = None
) -> QuantizedRows:
    """Quantizes every row of ``x`` to ``bits`` bits with unbiased stochastic rounding.

    Args:
        x: ``[N, D]`` floating tensor (CPU or any device); ``N`` and ``D`` may be 0.  Not
            differentiated (it is detached).
        bits: 1, 2, 4 or 8.
        generator: Source of the dither, on ``x``'s device; the same seed gives the same bytes
            (for the same shape and device).  ``None``: the device's default generator.
        out: Optional ``[N, row_nbytes(D, bits)]`` uint8 tensor on ``x``'s device (e.g. a slice
            of a larger send buffer) to write the records into; its rows may be strided, its
            bytes within a row must be contiguous.

    Returns:
        :class:`QuantizedRows` with ``payload_nbytes(N, D, bits)`` bytes of records.

    Raises:
        ValueError: ``bits`` unsupported, ``x`` not 2-D or not floating, NaN/inf in ``x``, or a
            row whose ``max - min`` overflows float32.
    """
    bits = _check_bits(bits)
    x = _as_2d_float(x)
    n, d = x.shape
    dev = x.device
    levels = (1 << bits) - 1
    nb = packed_row_nbytes(d, bits)
    if out is None:
        buf = _empty((n, META_NBYTES + nb), torch.uint8, dev)
    else:
        if (
            out.dtype != torch.uint8
            or tuple(out.shape) != (n, META_NBYTES + nb)
            or out.device != dev
            or (out.numel() > 0 and out.stride(1) != 1)
        ):
            raise ValueError(
                f"out must be uint8 of shape {(n, META_NBYTES + nb)} on {dev} with unit column stride"
            )
        buf = out
    result = QuantizedRows(buf, bits, (n, d))
    if n == 0:
        return result
    if d == 0:
        buf.zero_()
        return result

    lim = float(levels * _ONE)
    mn = torch.empty(n, dtype=torch.float32, device=dev)
    rng = torch.empty(n, dtype=torch.float32, device=dev)
    scale = torch.empty(n, dtype=torch.float32, device=dev)
    rows = _chunk_rows(n, d, dev)
    work = torch.empty((rows, d), dtype=torch.float32, device=dev)
    fixed = work.view(torch.int32)  # the int32 fixed point overwrites the float work in place
    work64: Tensor | None = None
    rand = torch.empty(-(-rows * d // 4), dtype=torch.int64, device=dev)
    dither = torch.empty((rows, d), dtype=torch.int32, device=dev)
    packed = buf[:, META_NBYTES:]
    u16 = _uint16_copy_ok(dev)
    if bits < 8:
        lv = torch.zeros((rows, nb * (8 // bits)), dtype=torch.uint8, device=dev)  # padding stays 0
        words = lv.view(_WORD_DTYPE[bits])  # [rows, nb]: one word per packed byte
        wtmp = torch.empty_like(words)

    for s in range(0, n, rows):
        e = min(n, s + rows)
        r = e - s
        xc, mnc, rngc, sc = x[s:e], mn[s:e], rng[s:e], scale[s:e]
        # Row statistics per chunk, while the chunk is in cache (x is read from memory once).
        torch.amin(xc, dim=1, out=mnc)
        torch.amax(xc, dim=1, out=rngc)
        rngc.sub_(mnc)  # NaN/inf if the row holds NaN/inf or the range overflows
        # Fixed-point scale: T = (x - mn) * sc in units of 2^-16 level; constant rows get 0.
        torch.reciprocal(rngc, out=sc)
        sc.mul_(lim)
        sc.masked_fill_(rngc == 0, 0.0)
        w = work[:r]
        if bool(torch.isfinite(sc * rngc).all()):
            torch.sub(xc, mnc[:, None], out=w)
            w.mul_(sc[:, None])
        else:
            if not bool(torch.isfinite(rngc).all()):
                _raise_non_finite(mnc, torch.amax(xc, dim=1), s)
            # Ranges below ~1e-32 (subnormal data): the float32 scale overflows.  This chunk is
            # computed in float64, where every float32 range has a finite scale.
            if work64 is None:
                work64 = torch.empty((rows, d), dtype=torch.float64, device=dev)
            r64 = rngc.double()
            sc64 = torch.where(r64 > 0, lim / r64, torch.zeros_like(r64))
            w64 = work64[:r]
            torch.sub(xc, mnc.double()[:, None], out=w64)
            w64.mul_(sc64[:, None])
            w.copy_(w64.clamp_max_(lim))
        w.clamp_max_(lim)  # absorbs float error: T <= L 2^16 so q <= L
        fx = fixed[:r]
        fx.copy_(w)  # truncation = floor, w >= 0
        nrand = -(-r * d // 4)
        rv = rand[:nrand]
        rv.random_(-(1 << 63), None, generator=generator)  # 64 uniform bits -> four 16-bit dithers
        dv = dither[:r]
        if u16:
            dv.copy_(rv.view(torch.uint16)[: r * d].view(r, d))  # uniform on [0, 2^16)
        else:
            dv.copy_(rv.view(torch.int16)[: r * d].view(r, d))
            dv.bitwise_and_(0xFFFF)  # the same value as the uint16 view
        fx.add_(dv)
        fx.bitwise_right_shift_(DITHER_BITS)  # q in [0, L]
        if bits == 8:
            packed[s:e].copy_(fx)
            continue
        lv[:r, :d].copy_(fx)
        wv, tv = words[:r], wtmp[:r]
        if bits == 4:
            torch.bitwise_right_shift(wv, 4, out=tv)  # bytes [hi, lo] -> low byte hi << 4 | lo
            tv.bitwise_or_(wv)
        else:
            torch.mul(wv, _PACK_MUL[bits], out=tv)
            tv.bitwise_right_shift_(_PACK_SHIFT[bits])
        packed[s:e].copy_(tv)  # the low byte of every word
    buf[:, 0:4].copy_(mn.view(torch.uint8).view(n, 4))
    buf[:, 4:8].copy_(rng.view(torch.uint8).view(n, 4))
    return result


def _unpack_into(words: Tensor, tmp: Tensor, bits: int) -> None:
    """In place: each word holding one packed byte becomes 8/b bytes holding one level each."""
    if bits == 4:
        torch.bitwise_left_shift(words, 4, out=tmp)
        words.bitwise_or_(tmp)
        words.bitwise_and_(0x0F0F)
    elif bits == 2:
        torch.bitwise_and(words, 0xCC, out=tmp)  # levels 1 and 3 -> bytes 1 and 3
        tmp.mul_((1 << 6) | (1 << 18))
        words.bitwise_and_(0x33)  # levels 0 and 2 -> bytes 0 and 2
        words.mul_(1 | (1 << 12))
        words.bitwise_or_(tmp)
        words.bitwise_and_(0x03030303)
    else:
        torch.bitwise_and(words, 0x80, out=tmp)  # bit 7 -> byte 7 (kept apart: no carries)
        tmp.bitwise_left_shift_(49)
        words.bitwise_and_(0x7F)
        words.mul_(0x0002040810204081)  # bit i -> bit 8 i, i < 7
        words.bitwise_and_(0x0101010101010101)
        words.bitwise_or_(tmp)


def dequantize(q: QuantizedRows, out: Tensor | None = None) -> Tensor:
    """Reconstructs ``x^ = mn + q * rng / (2^b - 1)`` row by row.

    Args:
        q: A message from :func:`quantize` or :meth:`QuantizedRows.from_bytes`.
        out: Optional ``[N, D]`` float32 tensor to write into (saves the allocation).

    Returns:
        ``[N, D]`` float32 on ``q.buffer``'s device (``out`` if given).  Constant rows come back
        exactly; 1-bit rows hold only ``mn`` and ``mn + rng`` (= max up to float32 rounding).
    """
    n, d = q.shape
    bits = _check_bits(q.bits)
    dev = q.buffer.device
    if out is None:
        out = _empty((n, d), torch.float32, dev)
    elif out.dtype != torch.float32 or tuple(out.shape) != (n, d) or out.device != dev:
        raise ValueError(f"out must be float32 of shape {(n, d)} on {dev}")
    if n == 0 or d == 0:
        return out
    mn = q.mn
    rng = q.rng
    step = rng / float((1 << bits) - 1)
    if bool(((step < _TINY32) & (step > 0)).any()):
        # Subnormal steps (ranges below ~1e-36) have too few significant bits: scale in float64.
        step = rng.double() / float((1 << bits) - 1)
        mn = mn.double()
        work = torch.empty((min(n, _chunk_rows(n, d, dev)), d), dtype=torch.float64, device=dev)
    else:
        work = None
    packed = q.packed
    rows = _chunk_rows(n, d, dev)
    if bits < 8:
        nb = packed.shape[1]
        lv = torch.empty((rows, nb * (8 // bits)), dtype=torch.uint8, device=dev)
        words = lv.view(_WORD_DTYPE[bits])
        wtmp = torch.empty_like(words)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        r = e - s
        if bits == 8:
            src = packed[s:e]
        else:
            wv = words[:r]
            wv.copy_(packed[s:e])
            _unpack_into(wv, wtmp[:r], bits)
            src = lv[:r, :d]
        o = out[s:e] if work is None else work[:r]
        o.copy_(src)
        o.mul_(step[s:e, None])
        o.add_(mn[s:e, None])
        if work is not None:
            out[s:e].copy_(o)
    return out


# -- variance -----------------------------------------------------------------------------
def row_variance(x: Tensor, bits: int) -> Tensor:
    """Exact expected squared error of :func:`quantize` per row.

    ``sum_j (x_j - lo_j)(hi_j - x_j)`` with ``lo_j``/``hi_j`` the levels around ``x_j``, i.e.
    ``step^2 sum_j f_j (1 - f_j)`` with ``f_j`` the fractional part of ``(x_j - mn) / step``.

    Args:
        x: ``[N, D]`` floating tensor.
        bits: 1, 2, 4 or 8.

    Returns:
        ``[N]`` float64 (float64 so that tiny ranges do not underflow).
    """
    bits = _check_bits(bits)
    x = _as_2d_float(x)
    n, d = x.shape
    if n == 0 or d == 0:
        return torch.zeros(n, dtype=torch.float64, device=x.device)
    mn, _, rng = _row_min_max(x)
    levels = (1 << bits) - 1
    step = rng.double() / levels
    t = (x.double() - mn.double()[:, None]) / torch.where(step > 0, step, torch.ones_like(step))[:, None]
    f = t - torch.floor(t)
    return (f * (1.0 - f)).sum(dim=1) * step * step


def _range_sq(mn: Tensor | float, mx: Tensor | float) -> Tensor | float:
    if isinstance(mn, Tensor) or isinstance(mx, Tensor):
        mn_t = torch.as_tensor(mn, dtype=torch.float64)
        mx_t = torch.as_tensor(mx, dtype=torch.float64, device=mn_t.device)
        return (mx_t - mn_t) ** 2
    return (float(mx) - float(mn)) ** 2


def variance_bound(mn: Tensor | float, mx: Tensor | float, row_len: int, bits: int) -> Tensor | float:
    """Worst-case expected squared error of a row: ``D (mx - mn)^2 / (4 (2^b - 1)^2)``.

    Attained when every element lies halfway between two levels.  Tensors give float64.
    """
    levels = (1 << _check_bits(bits)) - 1
    return _range_sq(mn, mx) * (row_len / (4.0 * levels * levels))


def adaqp_variance_model(mn: Tensor | float, mx: Tensor | float, row_len: int, bits: int) -> Tensor | float:
    """AdaQP's per-row variance model ``D (mx - mn)^2 / (6 (2^b - 1)^2)``.

    The mean of :func:`row_variance` when the elements' positions between levels are uniform
    (``E[f (1 - f)] = 1/6`` for ``f ~ U[0, 1)``); AdaQP uses it to assign bit-widths.
    Tensors give float64.
    """
    levels = (1 << _check_bits(bits)) - 1
    return _range_sq(mn, mx) * (row_len / (6.0 * levels * levels))

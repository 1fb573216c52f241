r"""Per-row stochastic quantization of halo rows (AdaQP, Sylvie), fast on CPU and GPU.

Quantizer
---------
Every row ``x`` (length ``D``) of a ``[N, D]`` message is quantized on its own, asymmetrically,
to ``b`` bits (``b`` in {1, 2, 4, 8}), with ``L = 2^b - 1`` levels above the bottom of a grid
``[lo, lo + R]`` that contains the row (``lo <= min(x)``, ``lo + R >= max(x)``, see *Row
metadata* for how ``lo`` and ``R`` are chosen)::

    step = R / L
    t_j = (x_j - lo) / step                       in [0, L]   (position in level units)
    q_j = floor(t_j + u_j),  u_j ~ U[0, 1)        in {0, .., L} (stochastic rounding)
    x^_j = lo + q_j * step                        (dequantized value)

``q_j`` is ``floor(t_j)`` or ``floor(t_j) + 1``, the latter with probability ``frac(t_j)``, so
``E[q_j] = t_j`` and ``E[x^_j] = x_j``: the quantizer is *unbiased*.  Its error has variance

    Var[x^_j] = frac(t_j) (1 - frac(t_j)) step^2 = (x_j - lo_j)(hi_j - x_j)

where ``lo_j <= x_j <= hi_j`` are the two levels around ``x_j``.  Per row (errors of different
elements are independent) the expected squared error is the sum over ``j`` of that product
(:func:`row_variance`).  It never exceeds ``D R^2 / (4 L^2)`` (:func:`variance_bound`, each
term is at most ``step^2 / 4``).  AdaQP's planning model ``D rng^2 / (6 L^2)``
(:func:`adaqp_variance_model`, ``rng = max(x) - min(x)``) is the average when the fractional
parts are uniform (``E[u(1 - u)] = 1/6``) and the grid is exactly ``[min, max]``; the stored
grid is slightly wider (below).  With ``b = 1`` (Sylvie) every element becomes ``lo`` or
``lo + R``.

Row metadata: 16-bit, rounded outward
-------------------------------------
``lo`` and ``R`` are sent in 16 bits each, and the grid is computed from the *stored* values,
so quantizer and dequantizer use the very same levels and unbiasedness is exact whatever the
16-bit rounding did -- provided the stored grid still contains the row.  It is rounded
outward:

* ``lo`` = ``min(x)`` rounded toward ``-inf`` to **bfloat16** (sign, float32's 8-bit exponent,
  7 mantissa bits: the high half of the float32 bit pattern).
* ``R`` = ``max(x) - lo`` (computed exactly: the float32 subtraction plus its exact rounding
  error, Knuth's TwoSum) rounded toward ``+inf`` to a sign-less 16-bit float: **bits 30..15 of
  the float32 pattern** (float32's 8-bit exponent, 8 mantissa bits; a range is never negative,
  so its sign bit is spent on one more mantissa bit).

Both share float32's exponent range, so every float32 row (up to ~3.39e38, see below) has a
16-bit grid: no overflow where float16 overflows (beyond 65504), no flush of tiny ranges
(float16 loses ranges below ~6e-8; here ``R`` is rounded up by less than ``2^-134`` and ``lo``
down by less than ``2^-133`` even on subnormal rows).  The price is a wider grid: ``min(x) - lo < 2^-7 |min(x)|`` and ``R - (max(x) - lo) < 2^-8 R``, so

    R < (1 + 2^-8) (rng + 2^-7 |min(x)|)        (plus ~2^-133 on subnormal rows)

and the error variance grows with ``R^2``: at most +0.8% for rows whose minimum is 0 (ReLU
outputs; 0 is exact), at most +2.4% when ``|min(x)| <= rng`` (typical activations).  Rows far
from zero compared with their range widen much more: ``1000.5 + 1e-3 u`` gets ``lo = 1000``,
``R ~ 0.502``, i.e. an error of the order of bfloat16's rounding of the values themselves
(``2^-9 |x|``), still unbiased.  float16 for ``lo`` (3 more mantissa bits) would widen such
rows 8x less, but it overflows beyond 65504 and would need a per-row fallback format; the
extra bits matter only for rows far from zero relative to their range, so bfloat16 (with the
9-significant-bit range) keeps one code path that is right for every row.  The variance functions (:func:`row_variance`,
:func:`variance_bound`) use the stored grid; :attr:`QuantizedRows.rng` is still the true
float32 ``max - min`` of each row (for variance models that plan bit-widths).

*Constant rows* (``max == min == c``) come back exactly: when ``c`` is a bfloat16 value (0,
small integers, ...) the grid is ``[c, c]`` (``R = 0``); otherwise the record carries the
float32 bit pattern of ``c`` instead of a grid, marked by an ``R`` field whose exponent bits are
all ones (an infinite or NaN range, which a real row never has): its high 16 bits in the
``lo`` field (``lo`` is then ``c`` truncated to bfloat16), bits 8-15 in the low byte of the
``R`` field and bits 0-7 in the first packed byte (the levels of such a row are not used).

Rows whose grid leaves ``+-(2^128 - 2^119)`` (about +-3.396e38: rows with a value or a range
beyond ~3.39e38, the top 0.2% of float32's magnitudes) are rejected (``ValueError``), as are
NaN and inf; inside that bound the dequantized values never overflow float32.

Exact unbiasedness in fixed point, with a counter-based dither
---------------------------------------------------------------
Drawing a float ``u`` per element costs more than the whole rest of the quantizer, so the
dither is an integer.  ``t`` is scaled to fixed point with ``K = 16`` fractional bits,
``T = floor(t 2^K)`` (an ``int32``, ``0 <= T <= L 2^K``), and with ``r`` uniform on
``{0, .., 2^K - 1}``::

    q = (T + r) >> K

is ``floor(T / 2^K)`` plus one exactly when ``r >= 2^K - (T mod 2^K)``, which has probability
``(T mod 2^K) / 2^K``.  So ``E[q] = T / 2^K`` *exactly*: the rounding is exactly unbiased for the
fixed-point input, and the only bias with respect to ``t`` is the truncation
``0 <= t - T / 2^K < 2^-16`` level -- at 8 bits (``t`` up to 255) that is the size of the
float32 rounding error of ``t`` itself, and at any width it is below one part in 65536 of a
quantization step, far below the noise the rounding adds (standard deviation up to half a
step).  ``T <= L 2^K`` (enforced by a clamp that only absorbs float error, since the stored
grid contains the row) gives ``q <= L``: there is no ``u -> 1`` overflow into the next packed
value.  The exact variance of the fixed-point rounding is ``f (1 - f) step^2`` with
``f = frac(T / 2^K)``, which differs from :func:`row_variance` by less than ``2^-16 step^2``
per element.

The dither is **counter-based** (:func:`dither_hash`): one 32-bit key per call is drawn from
the generator, and element ``j`` of row ``i`` gets ``r = H((i D + j) mod 2^32 XOR key) >> 16``,
with ``H`` the two multiply rounds of ``lowbias32`` (``h ^= h >> 16; h *= 0x7FEB352D;
h ^= h >> 15; h *= 0x846CA68B``, all mod ``2^32``).  Every step of ``H`` is a bijection of
32-bit words, so for a uniform key ``H(index XOR key)`` is uniform on 32 bits and ``r`` exactly
uniform on 16: unbiasedness stays exact, element by element.  A call draws one number from the
generator (so its state, checkpointed by the policies, still fixes every byte), and the dither
is a pure function of (key, element): the torch path below and the one-pass CPU kernel
(:mod:`~lightning_fullgraph.comm.fused_kernels`) compute the same bytes.  Messages of more than
``2^32`` values (16 GiB of float32) reuse dithers after ``2^32`` elements.

Wire format (one ``uint8`` buffer, one fixed-size record per row)
------------------------------------------------------------------
Every row becomes a record of :func:`row_nbytes` ``= 4 + ceil(D b / 8)`` bytes::

    [ lo: bfloat16 | R: bits 30..15 of float32 | packed levels: ceil(D b / 8) bytes ]

so a message of ``N`` rows is a contiguous ``[N, row_nbytes]`` uint8 tensor of exactly
:func:`payload_nbytes` ``= N * row_nbytes`` bytes.  Because records have a fixed size, the rows a
transport sends to different ranks are contiguous byte ranges (split sizes = rows x
``row_nbytes``), and a receiver can rebuild any slice of rows.

* Levels: ``8 / b`` levels per byte, element ``j`` of a row in byte ``j // (8 / b)`` at bit
  offset ``b * (j % (8 / b))`` (least-significant field first, like
  ``numpy.packbits(bitorder="little")`` for ``b = 1``).  Each row is padded with zero levels to
  a multiple of ``8 / b`` elements, at most 7 bits per row.
* Metadata: two little-endian 16-bit fields, :data:`META_NBYTES` ``= 4`` bytes per row (see
  *Row metadata*; the constant-row form reuses them).  At ``D = 256``, 1 bit: 32 + 4 = 36 bytes
  per row against 1024 bytes of float32, **28.4x** less (25.6x with the former 8 bytes of
  float32 metadata); 8 bits: 260 bytes, 3.94x.
* Little-endian byte order of the host/device is assumed (every platform PyTorch supports).

Speed
-----
On CPU tensors both directions run, by default, in one pass per row compiled by numba
(:mod:`~lightning_fullgraph.comm.fused_kernels`; ``backend="torch"`` forces the torch path,
which also serves other devices and the rows the kernels leave to it).  Measured on one thread
of the 2-core development machine (100k x 256 float32, ``benchmarks/quantizer_speed.py``, CPU
time): quantize+pack about 3.8-4.1 GB/s of float32 input with the kernel against about
1.1 GB/s for the torch path, about 60 % of a plain copy of the same bytes; dequantize into a
reused buffer 7.2-7.4 GB/s against 3.7-4.3.  Without numba (not
installed, or an unsupported platform) the torch path runs, with one notice.

The torch path processes rows in chunks of ~2^18 elements that stay in the CPU cache; every
step is a vectorized in-place torch kernel on buffers allocated once per call (no Python loop
over rows or elements, no per-chunk temporaries of the chunk's size); row min/max and the
16-bit grid are computed chunk by chunk so the input is read from memory once; packing/
unpacking use word-level integer tricks (one multiply and one shift pack 8 one-bit levels).
``quantize`` rejects NaN/inf input with the per-row min/max it needs anyway.  Large CPU outputs
allocated here get ``MADV_HUGEPAGE`` advice (``hugepages=False`` turns it off): first-touch
page faults of a fresh 100 MB tensor otherwise cost more than the dequantization itself.  The
same code runs unchanged on CUDA (in larger chunks).  Packing and the dither multiply integers
that wrap around (two's complement), as every PyTorch backend does; the layout tests check
every byte pattern.

Shapes: input ``[N, D]`` (two dimensions only; ``N`` or ``D`` may be 0); any floating dtype
(computed in float32, so values beyond float32 range are rejected as non-finite).  Output of
:func:`dequantize`: ``[N, D]`` float32.
"""

from __future__ import annotations

import functools
import importlib
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BACKENDS",
    "DITHER_BITS",
    "META_NBYTES",
    "SUPPORTED_BITS",
    "QuantizedRows",
    "adaqp_variance_model",
    "dequantize",
    "dither_hash",
    "from_bytes",
    "packed_row_nbytes",
    "payload_nbytes",
    "prepare_codec",
    "quantize",
    "row_nbytes",
    "row_variance",
    "uses_kernels",
    "variance_bound",
]

SUPPORTED_BITS: tuple[int, ...] = (1, 2, 4, 8)
#: Bytes of per-row metadata: bfloat16 ``lo`` + 16-bit range ``R`` (module docstring).
META_NBYTES: int = 4
#: Fractional bits of the fixed-point dither (see the module docstring).
DITHER_BITS: int = 16
#: Implementations of :func:`quantize` / :func:`dequantize`: ``"auto"`` (the compiled CPU
#: kernel where it applies, else torch), ``"torch"``, ``"numba"`` (the kernel or an error).
BACKENDS: tuple[str, ...] = ("auto", "torch", "numba")

_ONE = 1 << DITHER_BITS
# Elements per chunk: ~1 MiB of float32 work buffer on CPU keeps the pipeline in L2/L3 while
# amortising the per-op dispatch cost; on accelerators larger chunks only bound the workspace.
_CPU_CHUNK_ELEMS = 1 << 18
_DEVICE_CHUNK_ELEMS = 1 << 24
_TINY32 = torch.finfo(torch.float32).tiny
# The stored grid [lo, lo + R] must lie within +-_GRID_MAX (2^128 - 2^119, ~3.396e38): the
# largest 16-bit range, and far enough below float32's max (2^128 - 2^104) that the
# dequantizer's rounding never overflows.
_GRID_MAX = float(2**128 - 2**119)
# A stored range field >= this (all-ones exponent: inf/NaN) marks an exact constant row.
_CONST_MARK = 0xFF00

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
    """Bytes of one row's record on the wire: ``META_NBYTES + packed_row_nbytes`` (``4 + ...``)."""
    return META_NBYTES + packed_row_nbytes(row_len, bits)


def payload_nbytes(num_rows: int, row_len: int, bits: int) -> int:
    """Exact size in bytes of the message for ``num_rows`` rows of ``row_len`` elements.

    ``num_rows * (4 + ceil(row_len * bits / 8))``: packed levels *and* 16-bit metadata, i.e.
    ``QuantizedRows.to_bytes().numel()``.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return num_rows * row_nbytes(row_len, bits)


def _chunk_rows(num_rows: int, row_len: int, device: torch.device) -> int:
    elems = _CPU_CHUNK_ELEMS if device.type == "cpu" else _DEVICE_CHUNK_ELEMS
    return max(1, min(num_rows, elems // max(row_len, 1)))


# -- the 16-bit grid ------------------------------------------------------------------------
# 0-d operands: an in-place op with a 0-d tensor dispatches ~2x faster than with a Python
# number, and the grid's ops run on short per-chunk vectors where dispatch is the cost.
_I31 = torch.tensor(31, dtype=torch.int32)
_LOW16 = torch.tensor(0xFFFF, dtype=torch.int32)
_HIGH16 = torch.tensor(-65536, dtype=torch.int32)  # 0xFFFF0000
_LOW15 = torch.tensor(0x7FFF, dtype=torch.int32)
_HIGH17 = torch.tensor(-32768, dtype=torch.int32)  # 0xFFFF8000


def _grid(
    mn: Tensor, mx: Tensor, lo: Tensor | None = None, rng16: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The stored grid of rows with float32 minima ``mn`` and maxima ``mx`` (1-D, contiguous).

    Returns ``(lo, rng16)`` (float32; written into the given contiguous buffers if any):
    ``lo`` is ``mn`` rounded toward ``-inf`` to bfloat16, ``rng16`` is ``mx - lo`` rounded toward
    ``+inf`` to 9 significant bits, so that ``lo + rng16 >= mx`` exactly.  Constant rows whose
    value is not a bfloat16 get a grid here too, but their records are replaced by the exact
    form (:func:`_write_metadata`; their levels are not used).  Integer arithmetic on the
    float32 bit patterns, exact on any device; NaN/inf rows give a NaN/inf grid.
    """
    b = mn.view(torch.int32)
    # Sign-magnitude: clearing the low 16 bits truncates toward 0; for negative values the
    # magnitude is first raised by 0xFFFF so that the truncation rounds toward -inf.
    lob = torch.bitwise_right_shift(b, _I31, out=None if lo is None else lo.view(torch.int32))
    lob.bitwise_and_(_LOW16).add_(b).bitwise_and_(_HIGH16)
    lo = lob.view(torch.float32)
    # TwoSum: mx - lo == s + err exactly (err is the rounding error of the subtraction).
    s = torch.sub(mx, lo, out=rng16)
    bp = s - mx
    err = (mx - (s - bp)).sub_(bp.add_(lo))
    # s >= 0: its bit pattern is monotone in its value, +1 is the next float32 up.  err > 0
    # exactly when its pattern is a positive integer.
    rb = s.view(torch.int32)
    rb.add_(err.view(torch.int32).clamp_(0, 1))
    rb.add_(_LOW15).bitwise_and_(_HIGH17)  # round up to a multiple of 2^15: bits 30..15 remain
    return lo, rb.view(torch.float32)


def _grid_ok(lo: Tensor, rng16: Tensor) -> Tensor:
    """Whether each grid lies within ``+-_GRID_MAX`` (False for NaN/inf rows)."""
    return (lo >= -_GRID_MAX) & ((lo + rng16) <= _GRID_MAX)


def _effective_grid(mn: Tensor, mx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(lo, R, ok)`` as the dequantizer sees them: constant rows are ``(c, 0)``."""
    lo, rng16 = _grid(mn, mx)
    ok = _grid_ok(lo, rng16)
    const = mx == mn
    return torch.where(const, mn, lo), rng16.masked_fill(const, 0.0), ok


def _decode_grid(records: Tensor) -> tuple[Tensor, Tensor]:
    """``(lo, R)`` (float32, ``[N]``) of ``[N, row_nbytes]`` records; exact constant rows
    decode to ``(c, 0)``."""
    n = records.shape[0]
    meta = torch.empty((n, 4), dtype=torch.uint8, device=records.device)
    meta.copy_(records[:, :META_NBYTES])  # one strided copy, then whole-word arithmetic
    word = meta.view(torch.int32).view(n)  # little-endian: lo16 | R16 << 16
    lob = torch.bitwise_left_shift(word, 16)  # bfloat16 lo: the high half of its float32
    r16 = torch.bitwise_right_shift(word, 16).bitwise_and_(0xFFFF)
    rb = r16.bitwise_left_shift(15)  # R: bits 30..15 of its float32
    if n > 0 and records.shape[1] > META_NBYTES and int(r16.amax()) >= _CONST_MARK:
        idx = torch.nonzero(r16 >= _CONST_MARK).squeeze(1)
        # float32 pattern of the constant: lo16 << 16 | R16 low byte << 8 | first packed byte
        low = records[idx, META_NBYTES].to(torch.int32)
        cb = r16[idx].bitwise_and_(0xFF).bitwise_left_shift_(8).bitwise_or_(low).bitwise_or_(lob[idx])
        lob[idx] = cb
        rb[idx] = 0
    return lob.view(torch.float32), rb.view(torch.float32)


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """A quantized ``[N, D]`` message, stored as its wire records.

    Attributes:
        buffer: ``[N, row_nbytes(D, bits)]`` uint8, one record per row (module docstring).
        bits: Bits per element, one of 1, 2, 4, 8.
        shape: ``(N, D)`` of the original tensor.
        row_min, row_range: ``[N]`` float32 true per-row ``min`` and ``max - min`` of the
            quantized tensor; set by :func:`quantize`, ``None`` for a message rebuilt from its
            bytes (they are not on the wire: the records hold the 16-bit grid).

    ``packed`` (``[N, ceil(D b / 8)]`` uint8, a strided view) is read from the records, and so
    are ``grid_lo`` and ``grid_range`` (``[N]`` float32 copies); ``mn`` and ``rng`` are the
    true statistics.
    """

    buffer: Tensor
    bits: int
    shape: tuple[int, int]
    row_min: Tensor | None = None
    row_range: Tensor | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        n, d = self.shape
        if self.buffer.dtype != torch.uint8 or tuple(self.buffer.shape) != (n, row_nbytes(d, self.bits)):
            raise ValueError(
                f"buffer must be uint8 of shape {(n, row_nbytes(d, self.bits))}, "
                f"got {self.buffer.dtype} {tuple(self.buffer.shape)}"
            )
        for name in ("row_min", "row_range"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"{name} must have shape {(n,)}, got {tuple(t.shape)}")

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

    @property
    def grid_lo(self) -> Tensor:
        """Bottom level of every row's stored grid, ``[N]`` float32 (``<=`` the row's min;
        the value itself for constant rows)."""
        return _decode_grid(self.buffer)[0]

    @property
    def grid_range(self) -> Tensor:
        """Stored grid range ``R`` of every row, ``[N]`` float32: the top level is
        ``grid_lo + grid_range`` (``>=`` the row's max); 0 for constant rows."""
        return _decode_grid(self.buffer)[1]

    def _stat(self, t: Tensor | None, what: str) -> Tensor:
        if t is None:
            raise ValueError(
                f"the true row {what} is known only to the sender (quantize's result); a message "
                "rebuilt from its bytes has the 16-bit grid: grid_lo, grid_range"
            )
        return t

    @property
    def mn(self) -> Tensor:
        """True per-row minimum of the quantized tensor, ``[N]`` float32 (sender side only)."""
        return self._stat(self.row_min, "minimum")

    @property
    def rng(self) -> Tensor:
        """True per-row range ``max - min``, ``[N]`` float32 (0 for constant rows; sender side
        only): the input of bit-width planning models, not the (wider) stored grid."""
        return self._stat(self.row_range, "range")

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
            A :class:`QuantizedRows` viewing ``buf`` (no copy when ``buf`` is contiguous),
            without the true row statistics (``mn``/``rng``), which are not on the wire.
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


def _raise_bad_rows(mn: Tensor, mx: Tensor, ok: Tensor, row0: int = 0) -> None:
    """Raises for the first non-finite row, else for the first row whose grid is not ``ok``."""
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    if not bool(finite.all()):
        row = row0 + int(torch.nonzero(~finite)[0])
        raise ValueError(f"cannot quantize non-finite values (NaN or inf), first in row {row}")
    if not bool(ok.all()):
        i = int(torch.nonzero(~ok)[0])
        raise ValueError(
            f"row {row0 + i} overflows the quantization grid (min {float(mn[i]):.5g}, max "
            f"{float(mx[i]):.5g}): the grid [lo, lo + range] must lie within +-{_GRID_MAX:.5g}"
        )


def _row_grid(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row stored grid ``lo``, ``R`` of a non-empty float32 ``x`` as the dequantizer sees
    it (constant rows ``(c, 0)``); raises on NaN/inf or grid overflow."""
    mn = torch.amin(x, dim=1)
    mx = torch.amax(x, dim=1)
    lo, rng16, ok = _effective_grid(mn, mx)
    if not bool(ok.all()):
        _raise_bad_rows(mn, mx, ok)
    return lo, rng16


# Hugepage advice for large CPU outputs: first-touch page faults of a fresh 100 MB tensor cost
# more than the whole dequantization on small VMs; MADV_HUGEPAGE cuts them ~500x in number.
_HUGEPAGE_MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` (a fresh ctypes prototype), or ``None`` off Linux or where it
    cannot be found.  A pure lookup, resolved on first use."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, use_errno=True)
        return proto(("madvise", ctypes.CDLL(None, use_errno=True)))
    except (OSError, AttributeError, TypeError):  # pragma: no cover - libc without madvise
        return None


def _advise_hugepages(t: Tensor) -> None:
    madvise = _libc_madvise()
    if madvise is None:  # pragma: no cover - not Linux
        return
    ptr = t.data_ptr()
    lo = -(-ptr // _HUGE) * _HUGE
    hi = (ptr + t.numel() * t.element_size()) // _HUGE * _HUGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a hint: failure (-1, errno) is harmless


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, hugepages: bool) -> Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if hugepages and device.type == "cpu" and t.numel() * t.element_size() >= _HUGEPAGE_MIN_BYTES:
        _advise_hugepages(t)
    return t


# -- the counter-based dither -------------------------------------------------------------
_H1 = torch.tensor(0x7FEB352D, dtype=torch.int32)
_H2 = torch.tensor(0x846CA68B - (1 << 32), dtype=torch.int32)  # 0x846CA68B as int32
_I15 = torch.tensor(15, dtype=torch.int32)
_I16 = torch.tensor(16, dtype=torch.int32)
_LOW17 = torch.tensor(0x1FFFF, dtype=torch.int32)


def _hash_(h: Tensor, key: Tensor, tmp: Tensor) -> Tensor:
    """In place: int32 element indices ``h`` -> their 16-bit dithers (``tmp``: scratch of the
    same shape).  Logical right shifts of int32 words are arithmetic shifts masked."""
    h.bitwise_xor_(key)
    torch.bitwise_right_shift(h, _I16, out=tmp).bitwise_and_(_LOW16)
    h.bitwise_xor_(tmp)
    h.mul_(_H1)
    torch.bitwise_right_shift(h, _I15, out=tmp).bitwise_and_(_LOW17)
    h.bitwise_xor_(tmp)
    h.mul_(_H2)
    return h.bitwise_right_shift_(_I16).bitwise_and_(_LOW16)


def _as_int32(value: int) -> int:
    """``value mod 2^32`` as a signed 32-bit integer."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def dither_hash(index: Tensor, key: int) -> Tensor:
    """The 16-bit dither of elements ``index`` under ``key`` (module docstring).

    Args:
        index: Integer tensor of element indices ``i * D + j`` (taken mod ``2^32``).
        key: The call's 32-bit key.

    Returns:
        ``int32`` tensor of ``index``'s shape, values in ``[0, 2^16)``; for a uniform random
        ``key`` each value is exactly uniform there.
    """
    h = index.to(torch.int64).to(torch.int32)  # mod 2^32 (the narrowing cast wraps)
    key_t = torch.tensor(_as_int32(key), dtype=torch.int32, device=index.device)
    return _hash_(h, key_t, torch.empty_like(h))


def _draw_key(generator: torch.Generator | None, device: torch.device) -> int:
    """One uniform 32-bit key per call, from ``generator`` (or the device's default one)."""
    where = generator.device if generator is not None else device
    return int(torch.empty((), dtype=torch.int64, device=where).random_(0, 1 << 32, generator=generator))


@functools.cache
def _fused_kernels() -> ModuleType | None:
    """The compiled CPU kernels (:mod:`~lightning_fullgraph.comm.fused_kernels`), or ``None``
    with one notice where numba cannot be imported."""
    try:
        fused_kernels = importlib.import_module("lightning_fullgraph.comm.fused_kernels")
    except ImportError as err:
        warnings.warn(
            f"lightning_fullgraph: numba is not available ({err}); the halo codec runs its torch "
            "path (the same bytes, 3-4x slower on CPU). `pip install numba` to speed it up.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return fused_kernels


def prepare_codec(device: torch.device | str) -> bool:
    """Loads (or, on a first run, compiles) the CPU kernels now, so that no training epoch
    pays for it; whether ``device``'s messages will use them.  A policy that quantizes calls it
    at setup (a first compilation takes a few seconds; numba then keeps the kernels on disk)."""
    return uses_kernels(device)


def uses_kernels(device: torch.device | str) -> bool:
    """Whether messages of tensors on ``device`` run the compiled kernels (``backend="auto"``),
    which read rows where they lie and write (or add) rows where they go: a caller that would
    gather rows for the codec, or add decoded rows up, leaves that to them when this holds."""
    return _kernels_for("auto", torch.device(device)) is not None


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _kernels_for(backend: str, device: torch.device) -> ModuleType | None:
    """The compiled kernels when ``backend`` and ``device`` call for them, else ``None``."""
    _check_backend(backend)
    if backend == "torch" or device.type != "cpu":
        if backend == "numba":
            raise ValueError(f"backend='numba' runs on CPU tensors only, got {device}")
        return None
    kernels = _fused_kernels()
    if kernels is None and backend == "numba":
        raise ImportError("backend='numba' needs numba: pip install numba")
    return kernels


def quantize(
    x: Tensor,
    bits: int,
    generator: torch.Generator | None = None,
    *,
    out: Tensor | None = None,
    hugepages: bool = True,
    backend: str = "auto",
    key: int | None = None,
) -> QuantizedRows:
    """Quantizes every row of ``x`` to ``bits`` bits with unbiased stochastic rounding.

    Args:
        x: ``[N, D]`` floating tensor (CPU or any device); ``N`` and ``D`` may be 0.  Not
            differentiated (it is detached).
        bits: 1, 2, 4 or 8.
        generator: Source of the call's dither key (one draw per call); the same state gives
            the same bytes on every device and backend.  ``None``: the default generator.
        out: Optional ``[N, row_nbytes(D, bits)]`` uint8 tensor on ``x``'s device (e.g. a slice
            of a larger send buffer) to write the records into; its rows may be strided, its
            bytes within a row must be contiguous.
        hugepages: Give a large (>= 8 MiB) CPU record buffer allocated here ``MADV_HUGEPAGE``
            advice (speed only: the bytes are the same either way).
        backend: One of :data:`BACKENDS` (speed only: the bytes are the same).
        key: The call's 32-bit dither key (module docstring); drawn from ``generator`` when
            ``None``.  Unbiasedness needs it uniformly random.

    Returns:
        :class:`QuantizedRows` with ``payload_nbytes(N, D, bits)`` bytes of records and the
        true per-row ``mn`` / ``rng``.

    Raises:
        ValueError: ``bits`` unsupported, ``x`` not 2-D or not floating, NaN/inf in ``x``, or a
            row whose grid leaves +-3.396e38 (module docstring).
    """
    bits = _check_bits(bits)
    x = _as_2d_float(x)
    n, d = x.shape
    dev = x.device
    kernels = _kernels_for(backend, dev)
    levels = (1 << bits) - 1
    nb = packed_row_nbytes(d, bits)
    if out is None:
        buf = _empty((n, META_NBYTES + nb), torch.uint8, dev, hugepages)
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
    mn = torch.zeros(n, dtype=torch.float32, device=dev)
    rng = torch.zeros(n, dtype=torch.float32, device=dev)
    result = QuantizedRows(buf, bits, (n, d), mn, rng)
    if n == 0:
        return result
    if d == 0:
        buf.zero_()
        return result
    if key is None:
        key = _draw_key(generator, dev)
    if kernels is not None:
        x = x.contiguous()
        flat, offsets = _record_span(buf)
        rows = torch.arange(n, dtype=torch.int64)
        done = kernels.quantize_gather(
            x.numpy(), rows.numpy(), flat.numpy(), offsets.numpy(), mn.numpy(), rng.numpy(), np.uint32(key), bits
        )
        if done < 0:
            _write_constant_rows(buf, mn, rng)
            return result
        # a row the kernel leaves to torch (non-finite, out of range, subnormal scale): the
        # torch path redoes the call, with the same key, and raises or gives the same bytes

    lim = float(levels * _ONE)
    lim_t = torch.tensor(lim, dtype=torch.float32)
    lo = torch.empty(n, dtype=torch.float32, device=dev)
    rng16 = torch.empty(n, dtype=torch.float32, device=dev)  # the stored ranges R
    mx = torch.empty(n, dtype=torch.float32, device=dev)
    rows = _chunk_rows(n, d, dev)
    work = torch.empty((rows, d), dtype=torch.float32, device=dev)
    fixed = work.view(torch.int32)  # the int32 fixed point overwrites the float work in place
    work64: Tensor | None = None
    key_t = torch.tensor(_as_int32(key), dtype=torch.int32, device=dev)
    # element index of (row, column) within a chunk; the chunk's first element is added per chunk
    offsets = torch.arange(rows, dtype=torch.int32, device=dev)[:, None] * d
    offsets = offsets + torch.arange(d, dtype=torch.int32, device=dev)[None, :]
    dither = torch.empty((rows, d), dtype=torch.int32, device=dev)
    scratch = torch.empty((rows, d), dtype=torch.int32, device=dev)
    packed = buf[:, META_NBYTES:]
    if bits < 8:
        lv = torch.zeros((rows, nb * (8 // bits)), dtype=torch.uint8, device=dev)  # padding stays 0
        words = lv.view(_WORD_DTYPE[bits])  # [rows, nb]: one word per packed byte
        wtmp = torch.empty_like(words)

    for s in range(0, n, rows):
        e = min(n, s + rows)
        r = e - s
        xc, mnc, mxc = x[s:e], mn[s:e], mx[s:e]
        # Row statistics and grid per chunk, while the chunk is in cache (x is read once).
        torch.amin(xc, dim=1, out=mnc)
        torch.amax(xc, dim=1, out=mxc)
        mnc.add_(0.0)  # -0.0 -> +0.0: a row holding both zeros gets one record (fused_kernels)
        mxc.add_(0.0)
        loc, rc = _grid(mnc, mxc, lo[s:e], rng16[s:e])
        # Fixed-point scale: T = (x - lo) * sc in units of 2^-16 level.  One reduction checks
        # the grid bounds (NaN/inf rows give NaN/inf) and that the float32 scale is finite
        # (R * sc is ~lim, inf for tiny ranges, NaN for R = 0, which fmax ignores).
        sc = torch.reciprocal(rc).mul_(lim_t)
        check = torch.maximum(loc + rc, loc.neg())
        torch.fmax(check, rc * sc, out=check)
        w = work[:r]
        if float(check.amax()) <= _GRID_MAX:
            sc.nan_to_num_(nan=0.0, posinf=0.0)  # R = 0 (x == lo): any finite scale gives T = 0
            torch.sub(xc, loc[:, None], out=w)
            w.mul_(sc[:, None])
        else:
            ok = _grid_ok(loc, rc)
            if not bool(ok.all()):
                _raise_bad_rows(mnc, mxc, ok, s)
            # Grid ranges below ~5e-32 (subnormal data): the float32 scale overflows.  This
            # chunk is computed in float64, where every float32 range has a finite scale.
            if work64 is None:
                work64 = torch.empty((rows, d), dtype=torch.float64, device=dev)
            r64 = rc.double()
            sc64 = torch.where(r64 > 0, lim / r64, torch.zeros_like(r64))
            w64 = work64[:r]
            torch.sub(xc, loc.double()[:, None], out=w64)
            w64.mul_(sc64[:, None])
            w.copy_(w64.clamp_max_(lim))
        w.clamp_max_(lim)  # absorbs float error: T <= L 2^16 so q <= L
        fx = fixed[:r]
        fx.copy_(w)  # truncation = floor, w >= 0
        dv = dither[:r]
        torch.add(offsets[:r], _as_int32(s * d), out=dv)  # (row * D + column) mod 2^32
        fx.add_(_hash_(dv, key_t, scratch[:r]))  # uniform on [0, 2^16)
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
    torch.sub(mx, mn, out=rng)
    _write_metadata(buf, lo, rng16.view(torch.int32))
    _write_constant_rows(buf, mn, rng)
    return result


def quantize_scattered(
    x: Tensor,
    index: Tensor,
    bits: int,
    buffer: Tensor,
    offsets: Tensor,
    generator: torch.Generator | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Quantizes the rows ``x[index]`` (one call: one key, row ``i`` of the call is
    ``x[index[i]]``) and writes record ``i`` to ``buffer[offsets[i] : offsets[i] + row_nbytes]``.

    The bytes are :func:`quantize`'s of ``x.index_select(0, index)``; on CPU the compiled kernel
    reads the rows in place and writes the records where they go (the rows of one bit-width of
    a mixed-width message: no gather, no concatenation).

    Args:
        x: ``[M, D]`` floating tensor.
        index: ``[n]`` int64 rows of ``x``.
        bits: 1, 2, 4 or 8.
        buffer: 1-D uint8 tensor (the whole message) on ``x``'s device.
        offsets: ``[n]`` int64 byte offsets of the records in ``buffer``.
        generator: Source of the call's key.
        backend: One of :data:`BACKENDS`.

    Returns:
        ``[n]`` float32 true ``max - min`` of every quantized row.
    """
    bits = _check_bits(bits)
    x = _as_2d_float(x)
    n, d = index.numel(), x.shape[1]
    dev = x.device
    kernels = _kernels_for(backend, dev)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=dev)
    key = _draw_key(generator, dev)
    if kernels is not None and d > 0 and buffer.is_contiguous():
        x = x.contiguous()
        mn = torch.empty(n, dtype=torch.float32)
        rng = torch.empty(n, dtype=torch.float32)
        done = kernels.quantize_gather(
            x.numpy(), index.numpy(), buffer.numpy(), offsets.numpy(), mn.numpy(), rng.numpy(), np.uint32(key), bits
        )
        if done < 0:
            # constant rows: their exact form, where it applies; only those records are
            # touched (ReLU's all-zero rows are constant and common, and need no exact form)
            idx = _exact_constant_rows(mn, rng)
            if idx is not None:
                head = offsets.index_select(0, idx)[:, None] + torch.arange(META_NBYTES + 1)
                buffer[head] = _constant_heads(mn, idx)
            return rng
    q = quantize(x.index_select(0, index), bits, key=key, backend="torch")
    buffer[offsets[:, None] + torch.arange(row_nbytes(d, bits), device=dev)] = q.buffer
    return q.rng


def dequantize_scattered(
    buffer: Tensor,
    offsets: Tensor,
    bits: int,
    row_len: int,
    index: Tensor,
    out: Tensor,
    *,
    accumulate: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Decodes the records at ``buffer[offsets[i]:]`` (``bits`` bits, ``row_len`` values) into
    the rows ``out[index[i]]`` (float32 ``[M, row_len]``): the rows of one bit-width of a
    mixed-width message, in place.  The rows are :func:`dequantize`'s.  Returns ``out``.

    With ``accumulate`` the rows are added instead, exactly as ``out.index_add_(0, index,
    rows)`` adds them (record order, float32 sums; ``index`` may repeat a row), without the
    ``[n, row_len]`` decoded rows: the halo-row gradients coming home to their owners."""
    bits = _check_bits(bits)
    n = index.numel()
    if n == 0 or row_len == 0:
        return out
    kernels = _kernels_for(backend, buffer.device)
    if kernels is not None and out.stride(1) == 1 and buffer.is_contiguous():
        done = kernels.dequantize_scatter(
            buffer.numpy(), offsets.numpy(), bits, row_len, index.numpy(), out.numpy(), accumulate
        )
        if done < 0:
            return out
        if accumulate:  # records before `done` are added already: the torch path adds the rest
            offsets, index, n = offsets[done:], index[done:], n - done
    records = buffer[offsets[:, None] + torch.arange(row_nbytes(row_len, bits), device=buffer.device)]
    rows = dequantize(QuantizedRows(records, bits, (n, row_len)), backend="torch")
    return out.index_add_(0, index, rows) if accumulate else out.index_copy_(0, index, rows)


def _record_span(records: Tensor) -> tuple[Tensor, Tensor]:
    """``(flat, offsets)``: the bytes from the first record to the end of the last as one 1-D
    view (records may be strided rows of a larger buffer; the bytes of a row are contiguous),
    and every record's offset in it."""
    n, width = records.shape
    step = records.stride(0) if n > 1 else width
    flat = records.as_strided(((n - 1) * step + width,), (1,))
    return flat, torch.arange(n, dtype=torch.int64) * step


def _write_metadata(buf: Tensor, lo: Tensor, rbits: Tensor) -> None:
    """Writes the 16-bit fields of every record (``rbits``: float32 patterns of the ranges,
    overwritten)."""
    n = buf.shape[0]
    # One int32 word per row, little-endian [lo16 | R16]: the high half of lo's pattern and
    # bits 30..15 of R's (R >= 0, its low 15 bits are 0).
    word = rbits.bitwise_right_shift_(15).bitwise_left_shift_(16)
    word.bitwise_or_(torch.bitwise_right_shift(lo.view(torch.int32), 16).bitwise_and_(0xFFFF))
    buf[:, :META_NBYTES].copy_(word.view(torch.uint8).view(n, 4))


def _exact_constant_rows(mn: Tensor, rng: Tensor) -> Tensor | None:
    """The rows that are constant and whose value is not a bfloat16 (they are sent in their
    exact form), ``[k]`` int64, or ``None`` where there are none."""
    if mn.numel() == 0 or float(rng.amin()) > 0:  # (a min reduction is much cheaper than a bool any())
        return None
    exact = (rng == 0).logical_and_(mn.view(torch.int32).bitwise_and(0xFFFF) != 0)
    if not bool(exact.any()):
        return None
    return torch.nonzero(exact).squeeze(1)


def _constant_heads(mn: Tensor, idx: Tensor) -> Tensor:
    """The first ``META_NBYTES + 1`` bytes of the exact-form records of rows ``idx``, ``[k, 5]``
    uint8, from the value's little-endian bytes b0..b3: b2, b3 (the lo field: the value's high
    half), b1 and the mark (the range field, :data:`_CONST_MARK` in its high byte), then b0
    (the first data byte)."""
    c = mn.index_select(0, idx).view(torch.uint8).view(-1, 4)  # little-endian bytes b0..b3
    mark = torch.full_like(c[:, 0], _CONST_MARK >> 8)
    return torch.stack([c[:, 2], c[:, 3], c[:, 1], mark, c[:, 0]], dim=1)


def _write_constant_rows(buf: Tensor, mn: Tensor, rng: Tensor) -> bool:
    """Writes the exact form of the constant rows whose value is not a bfloat16 (over their
    grid records); whether there were any."""
    if buf.shape[0] == 0:
        return False
    idx = _exact_constant_rows(mn, rng)
    if idx is None:
        return False
    buf[idx, 0 : META_NBYTES + 1] = _constant_heads(mn, idx)
    return True


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


def dequantize(
    q: QuantizedRows, out: Tensor | None = None, *, hugepages: bool = True, backend: str = "auto"
) -> Tensor:
    """Reconstructs ``x^ = lo + q * R / (2^b - 1)`` row by row from the stored grid.

    Args:
        q: A message from :func:`quantize` or :meth:`QuantizedRows.from_bytes`.
        out: Optional ``[N, D]`` float32 tensor to write into (saves the allocation).
        hugepages: Give a large (>= 8 MiB) CPU output allocated here ``MADV_HUGEPAGE``
            advice (speed only).
        backend: One of :data:`BACKENDS` (speed only: the rows are the same).

    Returns:
        ``[N, D]`` float32 on ``q.buffer``'s device (``out`` if given).  Constant rows come back
        exactly; 1-bit rows hold only ``grid_lo`` and ``grid_lo + grid_range``.
    """
    n, d = q.shape
    bits = _check_bits(q.bits)
    dev = q.buffer.device
    if out is None:
        out = _empty((n, d), torch.float32, dev, hugepages)
    elif out.dtype != torch.float32 or tuple(out.shape) != (n, d) or out.device != dev:
        raise ValueError(f"out must be float32 of shape {(n, d)} on {dev}")
    if n == 0 or d == 0:
        return out
    kernels = _kernels_for(backend, dev)
    if kernels is not None and out.stride(1) == 1 and q.buffer.stride(1) == 1:
        flat, offsets = _record_span(q.buffer)
        rows = torch.arange(n, dtype=torch.int64)
        if kernels.dequantize_scatter(flat.numpy(), offsets.numpy(), bits, d, rows.numpy(), out.numpy(), False) < 0:
            return out
        # an exact constant row or a subnormal step: the torch path decodes the whole call
    lo, rng16 = _decode_grid(q.buffer)
    step = rng16 / float((1 << bits) - 1)
    if bool(((step < _TINY32) & (step > 0)).any()):
        # Subnormal steps (ranges below ~1e-36) have too few significant bits: scale in float64.
        step = rng16.double() / float((1 << bits) - 1)
        lo = lo.double()
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
        o.add_(lo[s:e, None])
        if work is not None:
            out[s:e].copy_(o)
    return out


# -- variance -----------------------------------------------------------------------------
def row_variance(x: Tensor, bits: int) -> Tensor:
    """Exact expected squared error of :func:`quantize` per row.

    ``sum_j (x_j - lo_j)(hi_j - x_j)`` with ``lo_j``/``hi_j`` the levels of the stored grid
    around ``x_j``, i.e. ``step^2 sum_j f_j (1 - f_j)`` with ``step = R / L`` and ``f_j`` the
    fractional part of ``(x_j - lo) / step``.

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
    lo, rng16 = _row_grid(x)
    levels = (1 << bits) - 1
    step = rng16.double() / levels
    t = (x.double() - lo.double()[:, None]) / torch.where(step > 0, step, torch.ones_like(step))[:, None]
    f = t - torch.floor(t)
    return (f * (1.0 - f)).sum(dim=1) * step * step


def _grid_range_sq(mn: Tensor | float, mx: Tensor | float) -> Tensor | float:
    """``R^2`` (float64) of the stored grid of rows with float32 min ``mn`` and max ``mx``."""
    scalar = not (isinstance(mn, Tensor) or isinstance(mx, Tensor))
    mn_t = torch.as_tensor(mn, dtype=torch.float32)
    mx_t = torch.as_tensor(mx, dtype=torch.float32, device=mn_t.device)
    mn_t, mx_t = torch.broadcast_tensors(mn_t, mx_t)
    shape = mn_t.shape
    _, rng16, _ = _effective_grid(mn_t.reshape(-1).contiguous(), mx_t.reshape(-1).contiguous())
    r2 = rng16.double().reshape(shape) ** 2
    return float(r2) if scalar else r2


def variance_bound(mn: Tensor | float, mx: Tensor | float, row_len: int, bits: int) -> Tensor | float:
    """Worst-case expected squared error of a row: ``D R^2 / (4 (2^b - 1)^2)``.

    ``R`` is the stored grid range of a row with float32 minimum ``mn`` and maximum ``mx``
    (module docstring: ``max - min`` widened by less than ``2^-8 R + 2^-7 |min|``).  Attained
    when every element lies halfway between two levels.  Tensors give float64.
    """
    levels = (1 << _check_bits(bits)) - 1
    return _grid_range_sq(mn, mx) * (row_len / (4.0 * levels * levels))


def _range_sq(mn: Tensor | float, mx: Tensor | float) -> Tensor | float:
    if isinstance(mn, Tensor) or isinstance(mx, Tensor):
        mn_t = torch.as_tensor(mn, dtype=torch.float64)
        mx_t = torch.as_tensor(mx, dtype=torch.float64, device=mn_t.device)
        return (mx_t - mn_t) ** 2
    return (float(mx) - float(mn)) ** 2


def adaqp_variance_model(mn: Tensor | float, mx: Tensor | float, row_len: int, bits: int) -> Tensor | float:
    """AdaQP's per-row variance model ``D (mx - mn)^2 / (6 (2^b - 1)^2)``.

    The mean of :func:`row_variance` when the elements' positions between levels are uniform
    (``E[f (1 - f)] = 1/6``) and the grid is exactly ``[mn, mx]``; AdaQP uses it, on the true
    range (:attr:`QuantizedRows.rng`), to assign bit-widths.  The stored 16-bit grid is a
    little wider, which the model ignores (at most +2.4% when ``|mn| <= mx - mn``, module
    docstring).  Tensors give float64.
    """
    levels = (1 << _check_bits(bits)) - 1
    return _range_sq(mn, mx) * (row_len / (6.0 * levels * levels))

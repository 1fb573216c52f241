"""Tests of ``lightning_fullgraph.comm.quantize``: unbiasedness, variance, wire format, edge cases.

Every test runs twice: on the default path (on CPU the compiled one-pass kernels of
``comm/fused_kernels.py``) and on the torch path alone (``[torch]``), which also serves other
devices and the rows the kernels leave to it.

Statistical tests use fixed generator seeds (so they are deterministic) *and* tolerances derived
from the exact distribution (CLT with a discreteness allowance), so they are not marginal.  The
exact distribution is that of the *stored* 16-bit grid (``grid_lo``, ``grid_range``), which the
structural tests check against an independent exact (rational) computation.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch

from lightning_fullgraph.comm import quantize as Q
from lightning_fullgraph.comm.quantize import (
    META_NBYTES,
    QuantizedRows,
    adaqp_variance_model,
    dequantize,
    from_bytes,
    packed_row_nbytes,
    payload_nbytes,
    quantize,
    row_nbytes,
    row_variance,
    variance_bound,
)

BITS = (1, 2, 4, 8)
EPS32 = torch.finfo(torch.float32).eps
TINY_ABS = 2.0**-149  # one float32 subnormal step
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, params=["auto", "torch"])
def codec_path(request, monkeypatch) -> str:
    """The quantizer's implementation under test: ``auto`` (the compiled kernels on CPU) or
    ``torch`` (the kernels switched off, as without numba)."""
    if request.param == "torch":
        monkeypatch.setattr(Q, "_fused_kernels", lambda: None)
    return request.param


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _test_rows(d: int = 37) -> torch.Tensor:
    g = _gen(1234)
    rows = [
        torch.randn(d, generator=g),
        torch.rand(d, generator=g) * 10 - 5,
        torch.arange(d, dtype=torch.float32) / 4.0,  # many elements exactly on a level
        torch.full((d,), 0.75).index_fill_(0, torch.tensor([5]), -0.25),  # constant but one
        torch.randn(d, generator=g) ** 3,
        -1e-3 * torch.rand(d, generator=g),
    ]
    return torch.stack(rows)


def _adversarial_rows(d: int = 33) -> torch.Tensor:
    """Rows where a 16-bit grid rounded the wrong way would not contain the row."""
    g = _gen(99)
    u = torch.rand(8, d, generator=g)
    u[:, 0], u[:, 1] = 0.0, 1.0  # every row reaches both ends of its nominal range
    rows = [
        1000.5 + 1e-3 * u[0],  # far from zero, tiny range
        1003.0 + 1e-3 * u[1],  # min rounds *up* to bfloat16 1004 if rounded to nearest
        -1000.5 - 1e-3 * u[2],  # negative, far from zero
        1e30 * (torch.rand(d, generator=g) - 0.3),  # huge values
        1e30 * (1 + 1e-6 * u[3]),  # huge and far from zero
        1e-30 * u[4] - 3e-30,  # tiny range, negative
        1.0019 * u[5],  # R = 1.0019.. -> 1.0039 up, 1.0 to nearest
        torch.linspace(-(2.0**-30), 1.0, d),  # max - lo = 1 + 2^-30 rounds to 1.0 in float32
        -3.0 - 5.0 * u[6],  # negative row
        torch.full((d,), 0.1),  # constant, not a bfloat16
        torch.full((d,), -7e20),  # constant, not a bfloat16
        torch.full((d,), 3.25),  # constant bfloat16
    ]
    return torch.stack(rows)


def _stored_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, R) of the records quantize writes for x, in float64."""
    q = quantize(x, 8, _gen(0))
    return q.grid_lo.double(), q.grid_range.double()


def _grid_dist(x: torch.Tensor, bits: int):
    """Per element under the stored grid: lower level, level gap, probability of rounding up."""
    lo, rng = _stored_grid(x)
    lv = 2**bits - 1
    step = (rng / lv)[:, None]
    t = (x.double() - lo[:, None]) / torch.where(step > 0, step, torch.ones_like(step))
    t = t.clamp(0, lv)  # the quantizer clamps: outside the grid the level is saturated
    low = torch.floor(t)
    p = t - low
    return lo[:, None] + low * step, step.expand_as(t), p


def _check_unbiased(x: torch.Tensor, bits: int, n: int, seed: int) -> None:
    r, d = x.shape
    draws = dequantize(quantize(x.repeat(n, 1), bits, _gen(seed))).double().view(n, r, d)
    mean = draws.mean(0)
    _, step, p = _grid_dist(x, bits)
    var = p * (1 - p) * step**2
    # |mean - x| <= 6 sd (CLT) + two events' worth (discreteness at tiny p) + float32 rounding
    # of the dequantized values (a few ulps of the largest magnitude on the grid).
    big = torch.maximum(x.abs(), x.abs().amax(1, keepdim=True)).double()
    tol = 6 * (var / n).sqrt() + 2 * step / n + 4 * EPS32 * big + 4 * TINY_ABS
    err = (mean - x.double()).abs()
    worst = int((err - tol).flatten().argmax())
    assert bool((err <= tol).all()), (
        f"bits={bits}: row {worst // d} elem {worst % d}: err {err.flatten()[worst]:.3g} > tol "
        f"{tol.flatten()[worst]:.3g} (x={x.flatten()[worst].item():.9g})"
    )


# -- unbiasedness and variance ----------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_unbiased_and_variance_matches_row_variance(bits):
    """Mean and per-element/per-row variance of many draws match the exact distribution of
    the stored grid, and :func:`row_variance` is that exact variance.

    Negative control: a dequantizer that used the true ``min``/``max`` instead of the stored
    grid is biased by the widening (up to 2^-7 |min|) and fails the mean check on row 1; a
    ``row_variance`` on the true range fails the ``assert_close``."""
    x = _test_rows()
    r, d = x.shape
    n = 20000
    q = quantize(x.repeat(n, 1), bits, _gen(bits))  # n independent draws of every row
    draws = dequantize(q).double().view(n, r, d)
    mean = draws.mean(0)
    _, step, p = _grid_dist(x, bits)
    var = p * (1 - p) * step**2  # exact per-element variance (x - lo)(hi - x)

    tol = 6 * (var / n).sqrt() + 2 * step / n + 4 * EPS32 * x.abs().double() + 1e-12
    err = (mean - x.double()).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item():.3g}"

    # Aggregate: standardized errors have mean ~0 (catches small systematic biases).
    live = var > 1e-6 * step**2
    z = ((mean - x.double()) / (var / n).sqrt())[live]
    assert abs(z.mean().item()) < 5 / math.sqrt(z.numel())
    assert abs(z.std().item() - 1) < 0.25  # and unit variance: the per-element variance is right

    # Per row: sum of per-element sample variances vs row_variance, tolerance from the exact
    # fourth moment of a two-point distribution: Var(s^2) ~ p q (p - q)^2 h^4 / n.
    emp = draws.var(0, unbiased=True).sum(1)
    expected = row_variance(x, bits)
    torch.testing.assert_close(expected, var.sum(1), rtol=1e-9, atol=1e-15)
    sd = (p * (1 - p) * (2 * p - 1) ** 2 * step**4 / n).sum(1).sqrt()
    tol_row = 6 * sd + 4 * expected / n + 1e-12
    assert bool(((emp - expected).abs() <= tol_row).all()), (emp, expected, tol_row)
    assert bool((expected <= variance_bound(x.amin(1), x.amax(1), d, bits) * (1 + 1e-6)).all())


@pytest.mark.parametrize("bits", BITS)
def test_unbiased_on_adversarial_rows(bits):
    """E[dequantize(quantize(x))] = x on rows far from zero with tiny ranges, huge and tiny
    magnitudes, negative and constant rows (averages of 4000 draws, exact CLT bound).

    Negative controls: rounding ``min`` to the *nearest* bfloat16 instead of down puts row 1's
    grid above its values (1004 > 1003.x, error ~1); rounding the range to nearest instead of
    up leaves row 6's top (1.0019) outside the grid, saturated at 1.0 (error 1.9e-3, tolerance
    5e-4 at 1 bit, less at more bits)."""
    _check_unbiased(_adversarial_rows(), bits, n=4000, seed=bits + 10)


def test_stored_grid_is_the_tightest_outward_16bit_rounding():
    """``lo`` is the largest bfloat16 <= min, ``R`` the smallest 9-significant-bit float with
    ``lo + R >= max`` -- checked in exact rational arithmetic on adversarial rows and 600
    random rows of magnitudes 1e-35..1e35; constant rows have the grid ``(c, 0)``.

    Negative controls: ``min`` rounded to nearest fails ``lo <= min`` (row 1); the range rounded
    to nearest fails coverage (row 6); a plain float32 ``max - lo`` without the TwoSum
    correction fails coverage on row 7 (``lo = -2^-30``, ``max = 1``); a range always bumped one
    16-bit step up fails tightness; a bfloat16 (8-bit) range fails the 9-bit pattern check."""
    g = _gen(5)
    scale = 10.0 ** (torch.rand(600, 1, generator=g) * 70 - 35)
    offset = torch.randn(600, 1, generator=g) * 10.0 ** (torch.rand(600, 1, generator=g) * 6 - 3)
    rnd = (torch.randn(600, 9, generator=g) + offset) * scale
    for x in (_adversarial_rows(), rnd):
        lo, rng = (t.tolist() for t in _stored_grid(x))
        mn, mx = x.amin(1).tolist(), x.amax(1).tolist()
        for i in range(x.shape[0]):
            if mn[i] == mx[i]:
                assert (lo[i], rng[i]) == (mn[i], 0.0)
                continue
            lb, rb = _f32_bits(lo[i]), _f32_bits(rng[i])
            assert lb & 0xFFFF == 0 and rb & 0x7FFF == 0 and rb >> 31 == 0, (i, hex(lb), hex(rb))
            assert lo[i] <= mn[i], (i, lo[i], mn[i])
            above = torch.nextafter(
                torch.tensor(lo[i], dtype=torch.bfloat16), torch.tensor(math.inf).bfloat16()
            )
            assert float(above) > mn[i], (i, lo[i], mn[i])  # no bfloat16 between lo and min
            assert Fraction(lo[i]) + Fraction(rng[i]) >= Fraction(mx[i]), (i, lo[i], rng[i], mx[i])
            below = _f32(rb - 0x8000)  # the next smaller 9-bit range
            assert Fraction(lo[i]) + Fraction(below) < Fraction(mx[i]), (i, lo[i], rng[i], mx[i])


def test_grid_widening_is_bounded():
    """The stored range is below ``(1 + 2^-8)(rng + 2^-7 |min|)`` (module docstring), so the
    variance grows by at most 0.8% on rows with min 0 and 2.4% when ``|min| <= rng``.

    Negative control: a range rounded up to bfloat16 (8 significant bits) exceeds the bound
    on part of these rows (it may be up to ``2^-7`` too wide)."""
    g = _gen(6)
    x = torch.randn(4000, 16, generator=g) * 10.0 ** (torch.rand(4000, 1, generator=g) * 20 - 10)
    x[:1000] -= x[:1000].amin(1, keepdim=True)  # min exactly 0 (ReLU-like rows)
    x = x.float()
    mn, mx = x.amin(1).double(), x.amax(1).double()
    lo, rng = _stored_grid(x)
    true = mx - mn
    assert bool((rng <= (1 + 2.0**-8) * (true + 2.0**-7 * mn.abs())).all())
    ratio = (rng / true) ** 2
    assert float(ratio[:1000].max()) <= 1.008
    near = mn.abs() <= true
    assert bool(near.any()) and float(ratio[near].max()) <= 1.024
    assert bool((lo <= mn).all()) and bool((lo + rng >= mx).all())


@pytest.mark.parametrize("bits", BITS)
def test_dequantized_values_lie_within_the_stored_grid(bits):
    """Every dequantized value lies in ``[grid_lo, grid_lo + grid_range]`` (up to the float32
    rounding of the last multiply-add), and that grid contains ``[min, max]``.

    Negative control: a grid rounded to nearest (not outward) fails the containment of
    ``[min, max]`` on the adversarial rows."""
    x = torch.cat([_adversarial_rows(), _test_rows(33), torch.randn(50, 33, generator=_gen(1)) * 1e3])
    q = quantize(x, bits, _gen(2))
    y = dequantize(q).double()
    lo, rng = q.grid_lo.double()[:, None], q.grid_range.double()[:, None]
    hi = lo + rng
    slack = 2 * EPS32 * torch.maximum(lo.abs(), hi.abs()) + TINY_ABS
    assert bool((y >= lo - slack).all()) and bool((y <= hi + slack).all())
    assert bool((lo <= x.amin(1, keepdim=True).double()).all())
    assert bool((hi >= x.amax(1, keepdim=True).double()).all())
    assert torch.equal(q.mn, x.amin(1)) and torch.equal(q.rng, x.amax(1) - x.amin(1))  # true stats


def test_adaqp_model_is_mean_variance_for_uniform_fractions():
    x = torch.rand(200, 1000, generator=_gen(7))
    for bits in (2, 4):
        rv = row_variance(x, bits)
        model = adaqp_variance_model(x.amin(1), x.amax(1), 1000, bits)
        bound = variance_bound(x.amin(1), x.amax(1), 1000, bits)
        assert abs(rv.mean().item() / model.mean().item() - 1) < 0.02
        assert bool((rv <= bound).all())
    # Scalars work too, and the formulas are the documented ones (0 and 3 are exact grids).
    assert variance_bound(0.0, 3.0, 10, 2) == pytest.approx(10 * 9 / (4 * 9))
    assert adaqp_variance_model(-1.0, 1.0, 6, 1) == pytest.approx(6 * 4 / 6)


def test_variance_bound_uses_the_stored_grid():
    """``variance_bound`` is ``D R^2 / (4 L^2)`` with the stored range ``R``, so it bounds
    :func:`row_variance` also where the grid is much wider than the row; constant rows 0.

    Negative control: the bound on the true range (1e-3 for row 0) is ~2.5e5 times too small
    and fails ``rv <= bound``."""
    x = _adversarial_rows()
    mn, mx = x.amin(1), x.amax(1)
    _, rng = _stored_grid(x)
    for bits in BITS:
        bound = variance_bound(mn, mx, x.shape[1], bits)
        lv = 2**bits - 1
        torch.testing.assert_close(bound, x.shape[1] * rng**2 / (4 * lv * lv), rtol=1e-12, atol=0)
        assert bool((row_variance(x, bits) <= bound * (1 + 1e-9)).all())
        assert bool((bound[mn == mx] == 0).all())
    assert variance_bound(1000.5, 1000.501, 4, 1) == pytest.approx(4 * 0.501953125**2 / 4)


def test_one_bit_gives_only_the_grid_ends():
    x = torch.randn(9, 50, generator=_gen(3))
    q = quantize(x, 1, _gen(4))
    y = dequantize(q)
    lo, rng = q.grid_lo[:, None], q.grid_range[:, None]
    at_lo = y == lo
    at_hi = (y - (lo + rng)).abs() <= 2 * EPS32 * (lo + rng).abs()  # lo + 1 * R, one rounding
    assert bool((at_lo | at_hi).all())
    assert bool(at_lo.any(1).all()) and bool(at_hi.any(1).all())


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_within_one_step(bits):
    x = torch.randn(333, 29, generator=_gen(11)) * 3 + 1
    y = dequantize(quantize(x, bits, _gen(12)))
    _, rng = _stored_grid(x)
    step = (rng.float() / (2**bits - 1))[:, None]
    assert bool(((y - x).abs() <= step * (1 + 1e-5) + 4 * EPS32 * x.abs()).all())
    # Stochastic rounding moves each element to one of its two neighbouring levels only.
    assert bool(((y - x).abs() < step * 0.5).float().mean() > 0.4)


# -- wire format --------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_payload_size_is_exact(bits):
    """Records are ``4 + ceil(D b / 8)`` bytes.  Negative control: float32 metadata (8 bytes)
    fails every size."""
    assert META_NBYTES == 4
    for n in (0, 1, 7, 13):
        for d in (0, 1, 3, 7, 8, 9, 15, 16, 17, 100):
            q = quantize(torch.randn(n, d, generator=_gen(n * 100 + d)), bits, _gen(0))
            buf = q.to_bytes()
            assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            nb = math.ceil(d * bits / 8)
            assert packed_row_nbytes(d, bits) == nb
            assert row_nbytes(d, bits) == nb + META_NBYTES == nb + 4
            assert buf.numel() == payload_nbytes(n, d, bits) == n * (nb + 4) == q.nbytes
            assert tuple(q.packed.shape) == (n, nb)
            assert q.mn.dtype == q.rng.dtype == torch.float32 and q.mn.shape == (n,)
            assert q.grid_lo.dtype == q.grid_range.dtype == torch.float32 and q.grid_lo.shape == (n,)
    assert payload_nbytes(100_000, 256, 1) == 100_000 * 36  # 1024 / 36 = 28.4x below float32
    assert payload_nbytes(100_000, 256, 8) == 100_000 * 260


@pytest.mark.parametrize("bits", BITS)
def test_from_bytes_round_trip_and_row_slices(bits):
    n, d = 13, 11
    x = torch.randn(n, d, generator=_gen(5))
    x[3] = 0.1  # an exact constant row survives the trip too
    q = quantize(x, bits, _gen(6))
    y = dequantize(q)
    assert torch.equal(y[3], x[3])
    buf = q.to_bytes().clone()
    q2 = from_bytes(buf, n, d, bits)
    assert torch.equal(dequantize(q2), y)
    assert torch.equal(q2.grid_lo, q.grid_lo) and torch.equal(q2.grid_range, q.grid_range)
    assert torch.equal(q.mn, x.amin(1)) and torch.equal(q.rng, x.amax(1) - x.amin(1))
    with pytest.raises(ValueError, match="sender"):
        _ = q2.rng  # the true range is not on the wire
    assert torch.equal(QuantizedRows.from_bytes(buf, n, d, bits).buffer, q.buffer)
    # Fixed-size records: any row range is a contiguous byte range (per-destination splits).
    rb = row_nbytes(d, bits)
    part = from_bytes(buf[2 * rb : 9 * rb], 7, d, bits)
    assert torch.equal(dequantize(part), y[2:9])
    with pytest.raises(ValueError, match="bytes"):
        from_bytes(buf[:-1], n, d, bits)
    with pytest.raises(ValueError, match="uint8"):
        from_bytes(buf.to(torch.int16), n, d, bits)
    with pytest.raises(ValueError):
        QuantizedRows(buf.view(n, -1)[:, 1:], bits, (n, d))


def _levels_pattern(bits: int) -> torch.Tensor:
    """One row whose packed bytes are 0, 1, ..., 255 under the documented layout."""
    per, lv = 8 // bits, 2**bits - 1
    v = torch.arange(256)
    return torch.stack([(v >> (bits * i)) & lv for i in range(per)], dim=1).reshape(1, -1).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
def test_layout_every_byte_value(bits, device):
    # Integer rows holding 0 and L sit exactly on the levels (0 and L are exact 16-bit
    # metadata): quantization is deterministic.
    x = _levels_pattern(bits).to(device)
    q = quantize(x, bits, _gen(0, device))
    assert torch.equal(q.packed.cpu(), torch.arange(256, dtype=torch.uint8)[None])
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bits", BITS)
def test_layout_matches_spec_with_padding(bits):
    lv, per = 2**bits - 1, 8 // bits
    for d in (2, 3, 8, 9, 17, 30):
        levels = torch.randint(0, lv + 1, (7, d), generator=_gen(d))
        levels[:, 0], levels[:, -1] = 0, lv
        q = quantize(levels.float(), bits, _gen(1))
        expected = torch.zeros(7, math.ceil(d / per), dtype=torch.int64)
        for j in range(d):  # element j -> byte j // per, bit offset bits * (j % per)
            expected[:, j // per] |= levels[:, j] << (bits * (j % per))
        assert torch.equal(q.packed, expected.to(torch.uint8))
        assert torch.equal(dequantize(q), levels.float())
        if bits == 1:
            import numpy as np

            ref = np.packbits(levels.numpy().astype(np.uint8), axis=1, bitorder="little")
            assert np.array_equal(q.packed.numpy(), ref)


def test_metadata_record_layout():
    """``[lo: bfloat16 | R: bits 30..15 of float32]`` little-endian, and the exact constant
    form ``[c bytes 2, 3 | c byte 1, 0xFF | c byte 0 in the first packed byte]``, byte for byte
    from an independent ``struct`` encoding.

    Negative control: float16 metadata, big-endian fields or ``R`` stored as bfloat16 give
    other bytes."""
    x = torch.tensor([[1.5, -2.0, 4.0], [3.0, 3.0, 3.0], [0.1, 0.1, 0.1], [1000.5, 1000.501, 1000.5]])
    q = quantize(x, 4, _gen(0))
    rec = q.buffer.tolist()

    def le16(v: int) -> list[int]:
        return [v & 0xFF, v >> 8]

    assert rec[0][:4] == le16(_f32_bits(-2.0) >> 16) + le16(_f32_bits(6.0) >> 15)
    assert rec[1][:4] == le16(_f32_bits(3.0) >> 16) + [0, 0]
    c = list(struct.pack("<f", 0.1))
    assert rec[2][:5] == [c[2], c[3], c[1], 0xFF, c[0]]
    # 1000.5 .. 1000.501: lo = 1000 (bfloat16 below), R = 0.501.. up to 257 * 2^-9
    assert rec[3][:4] == le16(_f32_bits(1000.0) >> 16) + le16(_f32_bits(257 * 2.0**-9) >> 15)
    assert q.grid_lo.tolist() == [-2.0, 3.0, torch.tensor(0.1).item(), 1000.0]
    assert q.grid_range.tolist() == [6.0, 0.0, 0.0, 257 * 2.0**-9]


# -- edge cases ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_constant_and_zero_rows_are_exact(bits):
    """Constant rows come back bit-exact, bfloat16 values or not (exact record form).

    Negative control: quantizing a constant row like any other (``lo`` = bfloat16 below ``c``,
    ``R`` up to ``c``) gives values ``lo`` or ``lo + R``, not ``c``."""
    x = torch.randn(10, 13, generator=_gen(2))
    x[1] = 3.25
    x[3] = 0.0
    x[4] = -7e20
    x[5] = 1e-42  # a subnormal constant
    x[6] = 0.1
    x[7] = -3.3e38  # near the bottom of the range
    x[8] = 3.39e38  # above bfloat16's largest value (3.3895e38), inside the grid bound
    x[9] = -0.1
    y = dequantize(quantize(x, bits, _gen(3)))
    assert torch.isfinite(y).all()
    for i in (1, 3, 4, 5, 6, 7, 8, 9):
        assert torch.equal(y[i], x[i]), i
    zeros = dequantize(quantize(torch.zeros(5, 9), bits))  # default generator
    assert torch.equal(zeros, torch.zeros(5, 9))
    one = dequantize(quantize(torch.full((3, 1), 0.3), bits))  # D = 1: one packed byte
    assert torch.equal(one, torch.full((3, 1), 0.3))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-40])
def test_huge_tiny_and_subnormal_ranges(bits, scale):
    g = _gen(8)
    x = torch.cat([torch.randn(4, 21, generator=g) * scale, torch.randn(2, 21, generator=g)])
    if scale < 1e-38:
        assert (x[:4].abs() < torch.finfo(torch.float32).tiny).any()  # really subnormal
    y = dequantize(quantize(x, bits, _gen(9)))
    assert torch.isfinite(y).all()
    lo, rng = (t.float()[:, None] for t in _stored_grid(x))
    step = rng / (2**bits - 1)
    slack = 4 * EPS32 * x.abs().amax(1, keepdim=True) + 4 * TINY_ABS
    assert bool(((y - x).abs() <= step * (1 + 1e-5) + slack).all())
    assert bool((y >= lo - slack).all()) and bool((y <= lo + rng + slack).all())
    # Still unbiased at these magnitudes (the 1e-40 case runs the float64 fallbacks).
    _check_unbiased(x[:1], bits, n=2000, seed=10)


def test_largest_magnitudes():
    """Rows up to ~3.38e38 are quantized without overflow, unbiased; a grid beyond
    +-(2^128 - 2^119) = +-3.396e38 is rejected.  Negative control: without the bound check, a
    row reaching 3.4028e38 (float32's max) gets an infinite range (NaN/inf output)."""
    big = 3.38e38
    x = torch.tensor([[-big, -big / 2, 0.0], [big / 3, big / 2, big], [-1.0, 0.0, 1e38]])
    for bits in BITS:
        y = dequantize(quantize(x, bits, _gen(bits)))
        assert torch.isfinite(y).all()
    _check_unbiased(x, 2, n=2000, seed=3)
    for row in ([0.0, 3.4028e38], [-3.4028e38, 1.0], [-3.4e38] * 2, [3.397e38] * 2):
        with pytest.raises(ValueError, match="overflows the quantization grid"):
            quantize(torch.tensor([row]), 8)


def test_range_overflow_is_rejected():
    with pytest.raises(ValueError, match="row 1 overflows the quantization grid"):
        quantize(torch.tensor([[0.0, 1.0], [-3e38, 3e38]]), 8)
    with pytest.raises(ValueError, match="overflows the quantization grid"):
        row_variance(torch.tensor([[-3e38, 3e38]]), 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(20, 5, generator=_gen(0))
    x[13, 2] = bad
    with pytest.raises(ValueError, match="non-finite.*row 13"):
        quantize(x, 4)
    with pytest.raises(ValueError, match="non-finite"):
        row_variance(x, 4)
    with pytest.raises(ValueError, match="non-finite.*row 0"):
        quantize(torch.full((1, 3), bad), 4)  # constant non-finite rows too


def test_empty_inputs():
    for bits in BITS:
        q = quantize(torch.empty(0, 10), bits)
        assert q.to_bytes().numel() == 0 and dequantize(q).shape == (0, 10)
        q = quantize(torch.empty(4, 0), bits)
        assert q.to_bytes().numel() == 4 * META_NBYTES and dequantize(q).shape == (4, 0)
        assert q.rng.tolist() == [0.0] * 4 and q.grid_range.tolist() == [0.0] * 4
        q = quantize(torch.empty(0, 0), bits)
        assert dequantize(q).shape == (0, 0)
        assert row_variance(torch.empty(3, 0), bits).shape == (3,)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(8), 8)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4), 8)
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.ones(2, 3, dtype=torch.int64), 8)
    import numpy as np

    assert quantize(torch.randn(2, 3), np.int64(4)).bits == 4  # e.g. from a MILP solution
    for bits in (0, 3, 16, True, 2.5, 8.0, None, "8"):
        with pytest.raises(ValueError, match="bits"):
            quantize(torch.randn(2, 3), bits)
    q = quantize(torch.randn(2, 3), 8)
    with pytest.raises(ValueError, match="out"):
        dequantize(q, out=torch.empty(3, 2))


def test_out_argument():
    x = torch.randn(40, 7, generator=_gen(0))
    q = quantize(x, 2, _gen(1))
    out = torch.full((40, 7), float("nan"))
    assert dequantize(q, out=out) is out
    assert torch.equal(out, dequantize(q))


# -- determinism, dtypes, strides, chunking ---------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_determinism_with_generator(bits):
    x = torch.randn(50, 33, generator=_gen(0))
    a = quantize(x, bits, _gen(42)).to_bytes()
    b = quantize(x, bits, _gen(42)).to_bytes()
    c = quantize(x, bits, _gen(43)).to_bytes()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Non-contiguous and other float dtypes give the very same bytes.
    assert torch.equal(quantize(x.t().contiguous().t(), bits, _gen(42)).to_bytes(), a)
    assert torch.equal(quantize(x.double(), bits, _gen(42)).to_bytes(), a)
    xh = x.half()
    assert torch.equal(
        quantize(xh, bits, _gen(42)).to_bytes(), quantize(xh.float(), bits, _gen(42)).to_bytes()
    )


def test_many_small_chunks(monkeypatch):
    monkeypatch.setattr(Q, "_CPU_CHUNK_ELEMS", 64)  # 5 rows of 13 per chunk, ragged last
    x = torch.randn(101, 13, generator=_gen(0))
    x[50:53] *= 1e-41  # a subnormal chunk in the middle takes the float64 path
    x[60] = 0.1  # an exact constant row
    lo, rng = (t.float()[:, None] for t in _stored_grid(x))
    for bits in BITS:
        lv = 2**bits - 1
        levels = torch.randint(0, lv + 1, (101, 13), generator=_gen(bits))
        levels[:, 0], levels[:, 1] = 0, lv
        q = quantize(levels.float(), bits, _gen(0))
        assert torch.equal(dequantize(q), levels.float())
        y = dequantize(quantize(x, bits, _gen(1)))
        step = rng / lv
        assert bool(((y - x).abs() <= step * (1 + 1e-5) + 1e-44).all())
        assert torch.equal(y[60], x[60])
    x[77, 3] = float("nan")
    with pytest.raises(ValueError, match="row 77"):
        quantize(x, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu_semantics(bits):
    """Same grid and exact constants on the GPU as on the CPU; unbiased; GPU bytes decode on
    the CPU."""
    x = torch.cat([_test_rows(33), _adversarial_rows()]).cuda()
    n = 2000
    q = quantize(x.repeat(n, 1), bits, _gen(0, "cuda"))
    assert q.buffer.is_cuda
    qc = quantize(x.cpu(), bits, _gen(0))
    assert torch.equal(q.grid_lo[: x.shape[0]].cpu(), qc.grid_lo)
    assert torch.equal(q.grid_range[: x.shape[0]].cpu(), qc.grid_range)
    mean = dequantize(q).double().view(n, *x.shape).mean(0).cpu()
    _, step, p = _grid_dist(x.cpu(), bits)
    big = x.cpu().abs().amax(1, keepdim=True).double()
    tol = 6 * (p * (1 - p) / n).sqrt() * step + 2 * step / n + 4 * EPS32 * big + 1e-12
    assert bool(((mean - x.cpu().double()).abs() <= tol).all())
    a = quantize(x, bits, _gen(5, "cuda")).to_bytes()
    assert torch.equal(a, quantize(x, bits, _gen(5, "cuda")).to_bytes())
    # Bytes written on the GPU decode on the CPU (same layout).
    qd = from_bytes(a.cpu(), *x.shape, bits)
    assert torch.equal(dequantize(qd), dequantize(from_bytes(a, *x.shape, bits)).cpu())


def test_quantize_into_send_buffer_and_grad_input():
    # Two groups at different widths packed back to back into one flat send buffer.
    a = torch.randn(10, 24, generator=_gen(0), requires_grad=True)
    b = torch.randn(7, 24, generator=_gen(1))
    na, nb_ = payload_nbytes(10, 24, 2), payload_nbytes(7, 24, 8)
    flat = torch.zeros(na + nb_, dtype=torch.uint8)
    qa = quantize(a, 2, _gen(2), out=flat[:na].view(10, -1))
    qb = quantize(b, 8, _gen(3), out=flat[na:].view(7, -1))
    assert qa.buffer.data_ptr() == flat.data_ptr()
    assert torch.equal(flat[:na], quantize(a, 2, _gen(2)).to_bytes())
    assert torch.equal(dequantize(from_bytes(flat[na:], 7, 24, 8)), dequantize(qb))
    with pytest.raises(ValueError, match="out"):
        quantize(b, 8, out=torch.empty(7, 5, dtype=torch.uint8))
    # Strided rows of a larger buffer (e.g. a column block of a send matrix), constants too.
    b[2] = 0.1
    wide = torch.zeros(7, payload_nbytes(1, 24, 8) + 5, dtype=torch.uint8)
    qs = quantize(b, 8, _gen(3), out=wide[:, 3:-2])
    assert torch.equal(qs.buffer, quantize(b, 8, _gen(3)).buffer)
    assert bool((wide[:, :3] == 0).all()) and bool((wide[:, -2:] == 0).all())
    assert torch.equal(dequantize(qs)[2], b[2])


def test_large_output_with_and_without_hugepage_advice():
    """The advice is a keyword, not process state: bytes and values are the same either way.

    Negative control: a module-level switch (the former ``HUGEPAGE_ADVICE``) or a cached
    ``_madvise`` global fails the attribute checks."""
    x = torch.randn(4096, 640, generator=_gen(0))  # 10 MB: above the advice threshold
    q = quantize(x, 8, _gen(1))
    y = dequantize(q)
    assert torch.equal(dequantize(q, hugepages=False), y)
    assert torch.equal(quantize(x, 8, _gen(1), hugepages=False).to_bytes(), q.to_bytes())
    for name in ("HUGEPAGE_ADVICE", "_madvise", "_U16_OK"):
        assert not hasattr(Q, name), name
    fn = Q._libc_madvise()
    assert fn is Q._libc_madvise()  # resolved once (functools.cache), a pure lookup
    import sys

    assert (fn is not None) == sys.platform.startswith("linux")

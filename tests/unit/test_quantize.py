"""Tests of ``lightning_fullgraph.comm.quantize``: unbiasedness, variance, wire format, edge cases.

Statistical tests use fixed generator seeds (so they are deterministic) *and* tolerances derived
from the exact distribution (CLT with a discreteness allowance), so they are not marginal.
"""

from __future__ import annotations

import math

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
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


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


def _grid(x: torch.Tensor, bits: int):
    """Per element: exact lower level, level gap, and probability of rounding up (float64)."""
    x64 = x.double()
    mn = x.amin(1).double()[:, None]
    rng = (x.amax(1) - x.amin(1)).double()[:, None]  # float32 range, as the quantizer sends it
    step = rng / (2**bits - 1)
    t = (x64 - mn) / torch.where(step > 0, step, torch.ones_like(step))
    lo = torch.floor(t)
    p = t - lo
    return mn + lo * step, step.expand_as(x64), p


# -- unbiasedness and variance ----------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_unbiased_and_variance_matches_row_variance(bits):
    x = _test_rows()
    r, d = x.shape
    n = 20000
    q = quantize(x.repeat(n, 1), bits, _gen(bits))  # n independent draws of every row
    draws = dequantize(q).double().view(n, r, d)
    mean = draws.mean(0)
    _, step, p = _grid(x, bits)
    var = p * (1 - p) * step**2  # exact per-element variance (x - lo)(hi - x)

    # Per element: |mean - x| <= 6 sd (CLT) + two events' worth (discreteness at tiny p)
    # + float32 rounding of the dequantized value.
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


def test_adaqp_model_is_mean_variance_for_uniform_fractions():
    x = torch.rand(200, 1000, generator=_gen(7))
    for bits in (2, 4):
        rv = row_variance(x, bits)
        model = adaqp_variance_model(x.amin(1), x.amax(1), 1000, bits)
        bound = variance_bound(x.amin(1), x.amax(1), 1000, bits)
        assert abs(rv.mean().item() / model.mean().item() - 1) < 0.02
        assert bool((rv <= bound).all())
    # Scalars work too, and the formulas are the documented ones.
    assert variance_bound(0.0, 3.0, 10, 2) == pytest.approx(10 * 9 / (4 * 9))
    assert adaqp_variance_model(-1.0, 1.0, 6, 1) == pytest.approx(6 * 4 / 6)


def test_one_bit_gives_only_min_or_max():
    x = torch.randn(9, 50, generator=_gen(3))
    q = quantize(x, 1, _gen(4))
    y = dequantize(q)
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    at_mn = y == mn
    at_mx = (y - mx).abs() <= 2 * EPS32 * mx.abs()  # mn + rng == mx up to one rounding
    assert bool((at_mn | at_mx).all())
    assert bool(at_mn.any(1).all()) and bool(at_mx.any(1).all())
    assert bool((y[x == mn] == mn.expand_as(x)[x == mn]).all())  # the minimum itself is exact


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_within_one_step(bits):
    x = torch.randn(333, 29, generator=_gen(11)) * 3 + 1
    y = dequantize(quantize(x, bits, _gen(12)))
    step = ((x.amax(1) - x.amin(1)) / (2**bits - 1))[:, None]
    assert bool(((y - x).abs() <= step * (1 + 1e-5) + 4 * EPS32 * x.abs()).all())
    # Stochastic rounding moves each element to one of its two neighbouring levels only.
    assert bool(((y - x).abs() < step * 0.5).float().mean() > 0.4)


# -- wire format --------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_payload_size_is_exact(bits):
    for n in (0, 1, 7, 13):
        for d in (0, 1, 3, 7, 8, 9, 15, 16, 17, 100):
            q = quantize(torch.randn(n, d, generator=_gen(n * 100 + d)), bits, _gen(0))
            buf = q.to_bytes()
            assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            nb = math.ceil(d * bits / 8)
            assert packed_row_nbytes(d, bits) == nb
            assert row_nbytes(d, bits) == nb + META_NBYTES == nb + 8
            assert buf.numel() == payload_nbytes(n, d, bits) == n * (nb + 8) == q.nbytes
            assert tuple(q.packed.shape) == (n, nb)
            assert q.mn.dtype == q.rng.dtype == torch.float32 and q.mn.shape == (n,)
    assert payload_nbytes(100_000, 256, 1) == 100_000 * 40
    assert payload_nbytes(100_000, 256, 8) == 100_000 * 264


@pytest.mark.parametrize("bits", BITS)
def test_from_bytes_round_trip_and_row_slices(bits):
    n, d = 13, 11
    x = torch.randn(n, d, generator=_gen(5))
    q = quantize(x, bits, _gen(6))
    y = dequantize(q)
    buf = q.to_bytes().clone()
    q2 = from_bytes(buf, n, d, bits)
    assert torch.equal(dequantize(q2), y)
    assert torch.equal(q2.mn, x.amin(1)) and torch.equal(q2.rng, x.amax(1) - x.amin(1))
    assert torch.equal(QuantizedRows.from_bytes(buf, n, d, bits).buffer, q.buffer)
    # Fixed-size records: any row range is a contiguous byte range (per-destination splits).
    rb = row_nbytes(d, bits)
    part = from_bytes(buf[4 * rb : 9 * rb], 5, d, bits)
    assert torch.equal(dequantize(part), y[4:9])
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
    # Integer rows holding 0 and L sit exactly on the levels: quantization is deterministic.
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
    x = torch.tensor([[1.5, -2.0, 4.0], [3.0, 3.0, 3.0]])
    q = quantize(x, 4, _gen(0))
    rec = q.buffer
    assert torch.equal(rec[:, 0:4].contiguous().view(torch.float32).flatten(), torch.tensor([-2.0, 3.0]))
    assert torch.equal(rec[:, 4:8].contiguous().view(torch.float32).flatten(), torch.tensor([6.0, 0.0]))


# -- edge cases ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
def test_constant_and_zero_rows_are_exact(bits):
    x = torch.randn(6, 13, generator=_gen(2))
    x[1] = 3.25
    x[3] = 0.0
    x[4] = -7e20
    x[5] = 1e-42  # a subnormal constant
    y = dequantize(quantize(x, bits, _gen(3)))
    assert torch.isfinite(y).all()
    for i in (1, 3, 4, 5):
        assert torch.equal(y[i], x[i])
    zeros = dequantize(quantize(torch.zeros(5, 9), bits))  # default generator
    assert torch.equal(zeros, torch.zeros(5, 9))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-40])
def test_huge_tiny_and_subnormal_ranges(bits, scale):
    g = _gen(8)
    x = torch.cat([torch.randn(4, 21, generator=g) * scale, torch.randn(2, 21, generator=g)])
    if scale < 1e-38:
        assert (x[:4].abs() < torch.finfo(torch.float32).tiny).any()  # really subnormal
    y = dequantize(quantize(x, bits, _gen(9)))
    assert torch.isfinite(y).all()
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    step = (mx - mn) / (2**bits - 1)
    slack = 4 * EPS32 * x.abs().amax(1, keepdim=True) + 4 * 2.0**-149
    assert bool(((y - x).abs() <= step * (1 + 1e-5) + slack).all())
    assert bool((y >= mn - slack).all()) and bool((y <= mx + slack).all())
    # Still unbiased at these magnitudes (the 1e-40 case runs the float64 fallback).
    n = 2000
    mean = dequantize(quantize(x[:1].repeat(n, 1), bits, _gen(10))).double().mean(0)
    _, st, p = _grid(x[:1], bits)
    tol = 6 * (p * (1 - p) / n).sqrt() * st + 2 * st / n + 8 * 2.0**-149 + 4 * EPS32 * x[:1].abs()
    assert bool(((mean - x[0].double()).abs() <= tol[0]).all())


def test_range_overflow_is_rejected():
    with pytest.raises(ValueError, match="overflows float32"):
        quantize(torch.tensor([[0.0, 1.0], [-3e38, 3e38]]), 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(20, 5, generator=_gen(0))
    x[13, 2] = bad
    with pytest.raises(ValueError, match="non-finite.*row 13"):
        quantize(x, 4)
    with pytest.raises(ValueError, match="non-finite"):
        row_variance(x, 4)


def test_empty_inputs():
    for bits in BITS:
        q = quantize(torch.empty(0, 10), bits)
        assert q.to_bytes().numel() == 0 and dequantize(q).shape == (0, 10)
        q = quantize(torch.empty(4, 0), bits)
        assert q.to_bytes().numel() == 4 * META_NBYTES and dequantize(q).shape == (4, 0)
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
    for bits in BITS:
        lv = 2**bits - 1
        levels = torch.randint(0, lv + 1, (101, 13), generator=_gen(bits))
        levels[:, 0], levels[:, 1] = 0, lv
        q = quantize(levels.float(), bits, _gen(0))
        assert torch.equal(dequantize(q), levels.float())
        y = dequantize(quantize(x, bits, _gen(1)))
        step = ((x.amax(1) - x.amin(1)) / lv)[:, None]
        assert bool(((y - x).abs() <= step * (1 + 1e-5) + 1e-44).all())
    x[77, 3] = float("nan")
    with pytest.raises(ValueError, match="row 77"):
        quantize(x, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu_semantics(bits):
    x = _test_rows().cuda()
    n = 2000
    q = quantize(x.repeat(n, 1), bits, _gen(0, "cuda"))
    assert q.buffer.is_cuda
    mean = dequantize(q).double().view(n, *x.shape).mean(0).cpu()
    _, step, p = _grid(x.cpu(), bits)
    tol = 6 * (p * (1 - p) / n).sqrt() * step + 2 * step / n + 4 * EPS32 * x.cpu().abs().double() + 1e-12
    assert bool(((mean - x.cpu().double()).abs() <= tol).all())
    a = quantize(x, bits, _gen(5, "cuda")).to_bytes()
    assert torch.equal(a, quantize(x, bits, _gen(5, "cuda")).to_bytes())
    # Bytes written on the GPU decode on the CPU (same layout).
    qc = from_bytes(a.cpu(), *x.shape, bits)
    assert torch.equal(dequantize(qc), dequantize(from_bytes(a, *x.shape, bits)).cpu())


def test_int16_dither_fallback_gives_same_bytes(monkeypatch):
    x = torch.randn(30, 17, generator=_gen(0))
    ref = quantize(x, 4, _gen(1)).to_bytes()
    monkeypatch.setitem(Q._U16_OK, "cpu", False)
    assert torch.equal(quantize(x, 4, _gen(1)).to_bytes(), ref)


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


def test_large_output_with_and_without_hugepage_advice(monkeypatch):
    x = torch.randn(4096, 640, generator=_gen(0))  # 10 MB: above the advice threshold
    q = quantize(x, 8, _gen(1))
    y = dequantize(q)
    monkeypatch.setattr(Q, "HUGEPAGE_ADVICE", False)
    assert torch.equal(dequantize(q), y)
    assert torch.equal(quantize(x, 8, _gen(1)).to_bytes(), q.to_bytes())

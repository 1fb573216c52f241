"""Row codec with per-row bit-widths (``lightning_fullgraph.comm.codec``)."""

from __future__ import annotations

import pytest
import torch

from lightning_fullgraph.comm import codec as C
from lightning_fullgraph.comm.codec import (
    LayoutCache,
    _decode_grouped,
    _encode_grouped,
    decode_rows,
    decode_rows_add,
    encode_rows,
    message_layout,
    message_nbytes,
)
from lightning_fullgraph.comm.quantize import quantize, row_nbytes

COUNTS = [7, 0, 12, 5]  # peer 1 gets nothing


def _rows(n: int = sum(COUNTS), d: int = 37, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 3


def _grid_range(rows: torch.Tensor) -> torch.Tensor:
    """``[S, 1]`` range of every row's stored 16-bit grid (a little wider than max - min; the
    grid does not depend on the bit-width)."""
    return quantize(rows, 8).grid_range[:, None]


@pytest.mark.parametrize("b", [1, 2, 4, 8])
def test_uniform_fast_path_equals_the_grouped_layout(b: int) -> None:
    """With one bit-width the fast path (no gather, no re-concatenation) produces the very
    bytes, split sizes and decoded rows of the general grouped path.

    Negative control: a fast path whose buffer is not in peer order (e.g. the records
    reversed) or that draws its dither in another order fails the byte comparison."""
    rows = _rows()
    bits = torch.full((rows.size(0),), b, dtype=torch.uint8)
    fast = encode_rows(rows, bits, COUNTS, generator=torch.Generator().manual_seed(3))
    layout = message_layout(bits, COUNTS, rows.size(1))
    slow = _encode_grouped(rows, COUNTS, layout, torch.Generator().manual_seed(3))
    assert torch.equal(fast.buffer, slow.buffer)
    assert fast.nbytes == slow.nbytes == [c * row_nbytes(rows.size(1), b) for c in COUNTS]
    assert torch.equal(fast.rng, slow.rng)
    out_fast = decode_rows(fast.buffer, bits, COUNTS, rows.size(1))
    out_slow = _decode_grouped(slow.buffer, COUNTS, rows.size(1), layout, None)
    assert torch.equal(out_fast, out_slow)
    # and it is a quantization of the rows: every value within one step (of the stored grid)
    step = _grid_range(rows) / (2**b - 1)
    assert bool(((out_fast - rows).abs() <= step * 1.0001).all())


def test_mixed_bit_widths_round_trip_in_row_order() -> None:
    """Rows of mixed bit-widths come back in their original order, each within its own
    step; the per-peer message sizes add up the rows' record sizes.

    Negative control: decoding with the bit-widths permuted (the receiver's layout out of
    step with the sender's) puts rows in the wrong places and fails."""
    rows = _rows(d=64)
    g = torch.Generator().manual_seed(1)
    bits = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)[torch.randint(0, 4, (rows.size(0),), generator=g)]
    enc = encode_rows(rows, bits, COUNTS, generator=g)
    assert enc.nbytes == message_nbytes(bits, COUNTS, 64) and sum(enc.nbytes) == enc.buffer.numel()
    out = decode_rows(enc.buffer, bits, COUNTS, 64)
    step = _grid_range(rows) / (2 ** bits.float()[:, None] - 1)
    assert bool(((out - rows).abs() <= step * 1.0001).all())
    assert torch.equal(enc.rng, rows.amax(1) - rows.amin(1))  # the TRUE range, not the grid's


def test_unbiased_over_draws() -> None:
    """The mean of many decoded 1-bit draws approaches the rows (stochastic rounding is unbiased)."""
    rows = _rows(n=24, d=16)
    bits = torch.ones(24, dtype=torch.uint8)
    counts = [10, 14]
    g = torch.Generator().manual_seed(0)
    acc = torch.zeros_like(rows)
    draws = 4000
    for _ in range(draws):
        enc = encode_rows(rows, bits, counts, generator=g)
        acc += decode_rows(enc.buffer, bits, counts, 16)
    spread = _grid_range(rows)
    # standard error of the mean of a Bernoulli-scaled value: <= spread / (2 sqrt(draws))
    assert bool(((acc / draws - rows).abs() <= 5 * spread / (2 * draws**0.5)).all())


@pytest.mark.parametrize("mixed", [False, True])
def test_round_trip_is_exact_at_the_grid_points(mixed: bool) -> None:
    """Rows whose values are levels of an exactly representable grid (integers 0..L, both
    ends present; shifted by a bfloat16 offset) and constant rows (also non-bfloat16 ones,
    which travel in the exact constant form) decode exactly through the codec, in row order.

    Negative control: widening a grid that needs no widening (e.g. the range always bumped
    one 16-bit step up), or losing the exact constant form, breaks the equality."""
    g = torch.Generator().manual_seed(7)
    n, d = sum(COUNTS), 19
    if mixed:
        bits = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)[torch.randint(0, 4, (n,), generator=g)]
    else:
        bits = torch.full((n,), 4, dtype=torch.uint8)
    lv = (2 ** bits.long() - 1)[:, None]
    rows = (torch.rand(n, d, generator=g) * (lv + 1)).floor().clamp_max(lv)
    rows[:, 0], rows[:, 1] = 0, lv[:, 0]
    rows = rows + torch.tensor([-2.0, 0.0, 1.5, 1024.0])[torch.arange(n) % 4][:, None]
    rows[3] = 0.1  # constant, not a bfloat16
    rows[10] = -7.25  # constant bfloat16
    enc = encode_rows(rows, bits, COUNTS, generator=g)
    assert torch.equal(decode_rows(enc.buffer, bits, COUNTS, d), rows)


def test_the_layout_cache_reuses_a_layout_until_the_bit_widths_change() -> None:
    """One layout per bit-width tensor: asking again for the same tensor returns the same
    object (no recount); changing the tensor in place, or another tensor with other widths,
    gives the layout of the new widths, never a stale one.

    Negative control (run): keying the cache on ``id(bits)`` alone returns the 2-bit layout
    after ``bits.fill_(8)`` and the byte counts assertion fails."""
    cache = LayoutCache()
    bits = torch.full((sum(COUNTS),), 2, dtype=torch.uint8)
    first = cache.get(bits, COUNTS, 16)
    assert cache.get(bits, COUNTS, 16) is first and len(cache) == 1
    assert first.nbytes == [c * row_nbytes(16, 2) for c in COUNTS]
    bits.fill_(8)
    changed = cache.get(bits, COUNTS, 16)
    assert changed.nbytes == [c * row_nbytes(16, 8) for c in COUNTS]
    assert changed.payload_bits == 8 * 16 * sum(COUNTS)
    mixed = torch.tensor([1, 8] * (sum(COUNTS) // 2), dtype=torch.uint8)
    assert cache.get(mixed, COUNTS, 16).nbytes == message_nbytes(mixed, COUNTS, 16)


@pytest.mark.parametrize("mixed", [False, True])
def test_decoding_into_a_given_buffer_writes_the_rows_there(mixed: bool) -> None:
    """``decode_rows(out=...)`` writes the very rows a fresh decode returns into the given
    rows (the halo rows of the buffer a conv reads) and returns that tensor.

    Negative control (run): ignoring ``out`` (decoding into a new tensor) leaves the buffer's
    rows as they were and the identity assertion fails."""
    rows = _rows()
    n = rows.size(0)
    bits = torch.tensor([1, 2, 4, 8] * n, dtype=torch.uint8)[:n] if mixed else torch.full((n,), 4, dtype=torch.uint8)
    enc = encode_rows(rows, bits, COUNTS, generator=torch.Generator().manual_seed(5))
    fresh = decode_rows(enc.buffer, bits, COUNTS, rows.size(1))
    buffer = torch.full((n + 3, rows.size(1)), -7.0)
    got = decode_rows(enc.buffer, bits, COUNTS, rows.size(1), out=buffer[3:])
    assert got.data_ptr() == buffer[3:].data_ptr()
    assert torch.equal(buffer[3:], fresh)
    assert bool((buffer[:3] == -7.0).all())


def _widths(n: int, mixed: bool, seed: int = 11) -> torch.Tensor:
    if not mixed:
        return torch.full((n,), 2, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([1, 2, 4, 8], dtype=torch.uint8)[torch.randint(0, 4, (n,), generator=g)]


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("mixed", [False, True])
def test_encoding_indexed_rows_gives_the_bytes_of_the_gathered_rows(mixed: bool, kernels: bool, monkeypatch) -> None:
    """``encode_rows(x, ..., index=i)`` (the sender's owned rows and its send index, read where
    they lie) gives the very bytes and ranges of ``encode_rows(x[i], ...)`` for the same
    generator state, with repeated and unsorted indices, on the compiled path and on the
    gathering fallback (``kernels=False``: other devices).

    Negative control (run): composing a mixed message's width groups from the group positions
    alone (``src = at``, forgetting ``index[at]``) encodes the wrong rows and fails; so does a
    single-width call that skips the index."""
    if not kernels:
        monkeypatch.setattr(C, "uses_kernels", lambda device: False)
    x = _rows(n=15, d=37, seed=4)
    n = sum(COUNTS)
    index = torch.randint(0, 15, (n,), generator=torch.Generator().manual_seed(2))
    bits = _widths(n, mixed)
    want = encode_rows(x.index_select(0, index), bits, COUNTS, generator=torch.Generator().manual_seed(8))
    got = encode_rows(x, bits, COUNTS, generator=torch.Generator().manual_seed(8), index=index)
    assert torch.equal(got.buffer, want.buffer)
    assert got.nbytes == want.nbytes
    assert torch.equal(got.rng, want.rng)


@pytest.mark.parametrize("mixed", [False, True])
def test_decoding_into_a_sum_adds_each_width_in_turn(mixed: bool, monkeypatch) -> None:
    """``decode_rows_add`` adds every decoded row into ``target[index[i]]`` (indices repeat: the
    gradients of one owned row from several peers) exactly as ``index_add_`` of the decoded rows
    does, one bit-width after the other; the compiled path (which never writes the decoded rows)
    and the decode-first fallback agree bit for bit.

    Negative control (run): the kernel writing instead of adding (``o[j] = ...`` in the
    accumulate branch) loses the target's values and the repeats; adding the widths in another
    order changes float32 sums and fails the bitwise comparison (mixed)."""
    n, d = sum(COUNTS), 37
    bits = _widths(n, mixed)
    enc = encode_rows(_rows(d=d), bits, COUNTS, generator=torch.Generator().manual_seed(6))
    index = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(3))  # many repeats
    start = _rows(n=5, d=d, seed=9)
    rows = decode_rows(enc.buffer, bits, COUNTS, d)
    want = start.clone()
    for b in (1, 2, 4, 8):
        at = (bits == b).nonzero().flatten()
        want.index_add_(0, index[at], rows[at])
    got = decode_rows_add(enc.buffer, bits, COUNTS, d, start.clone(), index)
    assert torch.equal(got, want)
    if not mixed:  # one width: exactly the decode-then-index_add of the plain exchange
        assert torch.equal(got, torch.index_add(start, 0, index, rows))
    monkeypatch.setattr(C, "uses_kernels", lambda device: False)
    assert torch.equal(decode_rows_add(enc.buffer, bits, COUNTS, d, start.clone(), index), want)

"""The compiled one-pass CPU codec (``comm/fused_kernels.py``) against the torch path: the same
bytes, the same rows, the torch path where the kernels step aside, and one notice without numba."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_fullgraph.comm import quantize as Q
from lightning_fullgraph.comm.quantize import dequantize, dither_hash, from_bytes, quantize

BITS = (1, 2, 4, 8)


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 1), (7, 3), (33, 37), (64, 256), (9, 1433), (700, 64)]
    cases = [torch.randn(shape, generator=g) * 3 for shape in shapes]
    edge = torch.randn(16, 40, generator=g)
    edge[0] = 0.0  # a zero row
    edge[1] = -0.0  # its negative twin: the same record as edge[0]
    edge[2, :20] = -0.0  # -0.0 and 0.0 in one row with min 0
    edge[2, 20:] = edge[2, 20:].abs()
    edge[3] = 1.2345  # a constant row that is not a bfloat16: exact form
    edge[4] = torch.relu(edge[4])
    edge[5] *= 1e-20  # tiny range
    edge[6] *= 1e30  # huge values
    edge[7] = edge[7] * 1e-3 + 1000.5  # far from zero against its range
    edge[8] = -edge[8].abs()  # all negative
    edge[9, 0] = -0.0
    cases.append(edge)
    return cases


@pytest.mark.parametrize("bits", BITS)
def test_the_kernels_give_the_torch_paths_bytes_and_rows(bits: int) -> None:
    """Same generator state, same bytes: every shape (widths that do not fill a byte, 1433
    features), zero rows of either sign, constant rows in their exact form, tiny, huge and
    offset rows; the same true row statistics; and both dequantizers give the same rows, into
    strided output rows too.

    Negative control (run): the kernel's first hash multiplier changed (0x7FEB352D ->
    0x7FEB352F) fails the byte comparison; the torch path without the ``+ 0.0`` of its row
    minima gives another record for the row holding -0.0 and 0.0."""
    for x in _rows():
        a = quantize(x, bits, torch.Generator().manual_seed(7), backend="torch")
        b = quantize(x, bits, torch.Generator().manual_seed(7), backend="numba")
        assert torch.equal(a.buffer, b.buffer), tuple(x.shape)
        assert torch.equal(a.mn, b.mn) and torch.equal(a.rng, b.rng)
        rows_t = dequantize(a, backend="torch")
        rows_n = dequantize(a, backend="numba")
        assert torch.equal(rows_t, rows_n), tuple(x.shape)
        wide = torch.full((x.shape[0], x.shape[1] + 5), -1.0)
        dequantize(a, out=wide[:, 2 : 2 + x.shape[1]], backend="numba")
        assert torch.equal(wide[:, 2 : 2 + x.shape[1]], rows_t)
        assert bool((wide[:, :2] == -1.0).all() and (wide[:, 2 + x.shape[1] :] == -1.0).all())
    edge = _rows()[-1]
    rec = quantize(edge, bits, torch.Generator().manual_seed(1)).buffer
    assert torch.equal(rec[0], rec[1])  # -0.0 and 0.0 rows: one record
    assert torch.equal(dequantize(from_bytes(rec.reshape(-1), *edge.shape, bits))[3], edge[3])


def test_records_written_into_a_strided_send_buffer_match() -> None:
    """The kernel writes records into the rows of a larger send buffer (strided rows), as the
    codec's grouped layout does, with the torch path's bytes.

    Negative control (run): writing with the buffer's row stride taken as the record size
    scrambles every row after the first and fails."""
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(3))
    width = Q.row_nbytes(24, 2)
    send = torch.zeros(50, width + 9, dtype=torch.uint8)
    quantize(x, 2, torch.Generator().manual_seed(4), out=send[:, 3 : 3 + width], backend="numba")
    ref = quantize(x, 2, torch.Generator().manual_seed(4), backend="torch").buffer
    assert torch.equal(send[:, 3 : 3 + width], ref)
    assert not send[:, :3].any() and not send[:, 3 + width :].any()


def test_rows_the_kernels_leave_to_torch_still_raise_or_decode() -> None:
    """Non-finite rows and grids out of range raise as on the torch path (the kernel hands the
    call back); subnormal rows come back within a step.

    Negative control (run): a kernel that reports neither non-finite rows nor grids out of
    range writes their records and ``quantize`` returns instead of raising."""
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    x[13, 2] = float("nan")
    with pytest.raises(ValueError, match="row 13"):
        quantize(x, 4, backend="numba")
    y = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y[2] = 3.0e38
    y[2, 0] = -3.0e38
    with pytest.raises(ValueError, match="overflows the quantization grid"):
        quantize(y, 4, backend="numba")
    z = torch.randn(6, 8, generator=torch.Generator().manual_seed(2)) * 1e-41
    q = quantize(z, 8, torch.Generator().manual_seed(0), backend="numba")
    assert torch.equal(q.buffer, quantize(z, 8, torch.Generator().manual_seed(0), backend="torch").buffer)
    assert torch.equal(dequantize(q, backend="numba"), dequantize(q, backend="torch"))


def test_the_dither_is_the_counter_hash_of_element_and_key() -> None:
    """The dither of element (i, j) is ``dither_hash(i * D + j, key)`` with one key drawn per
    call: quantizing rows whose positions are exact halfway points rounds up exactly where
    that dither's top bit is set.

    Negative control (run): keying the hash on ``i + j`` instead of ``i * D + j`` fails."""
    n, d = 9, 11
    levels = torch.arange(n * d).reshape(n, d) % 2  # 1 bit: positions 0/1, grid [0, 1] per row
    x = levels.float() * 0.0 + 0.5
    x[:, 0], x[:, 1] = 0.0, 1.0  # the grid of every row is exactly [0, 1]: 0.5 is half a step
    gen = torch.Generator().manual_seed(11)
    key = int(torch.empty((), dtype=torch.int64).random_(0, 1 << 32, generator=torch.Generator().manual_seed(11)))
    got = dequantize(quantize(x, 1, gen))
    r = dither_hash(torch.arange(n * d).reshape(n, d), key)
    expect = (r >= 1 << 15).float()  # T = 0.5 * 2^16: up exactly when r >= 2^15
    assert torch.equal(got[:, 2:], expect[:, 2:])
    assert torch.equal(got[:, :2], x[:, :2])


def test_without_numba_the_torch_path_runs_with_one_notice(monkeypatch) -> None:
    """Where numba cannot be imported, ``quantize`` says so once (a RuntimeWarning naming the
    fix) and runs the torch path, with the same bytes; ``backend="numba"`` then fails with
    the fix.

    Negative control (run): a loader that swallows the ImportError without a warning fails
    the ``pytest.warns``."""
    x = torch.randn(12, 10, generator=torch.Generator().manual_seed(0))
    ref = quantize(x, 2, torch.Generator().manual_seed(3), backend="numba").buffer
    Q._fused_kernels.cache_clear()
    monkeypatch.setitem(sys.modules, "lightning_fullgraph.comm.fused_kernels", None)
    try:
        with pytest.warns(RuntimeWarning, match="pip install numba"):
            q = quantize(x, 2, torch.Generator().manual_seed(3))
        assert torch.equal(q.buffer, ref)
        with pytest.raises(ImportError, match="pip install numba"):
            quantize(x, 2, backend="numba")
    finally:
        Q._fused_kernels.cache_clear()


def test_backend_names_are_checked() -> None:
    """An unknown backend, or the kernels on a tensor that is not on the CPU, is refused with
    the choices."""
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize(torch.zeros(2, 2), 2, backend="c")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU tensors only"):
            quantize(torch.zeros(2, 2, device="cuda"), 2, backend="numba")


def test_a_mixed_width_message_has_the_same_bytes_on_both_paths(monkeypatch) -> None:
    """A mixed-width message (AdaQP after an assignment): the kernels read each width's rows in
    place and write each record at its offset; the bytes, the row ranges and the decoded rows
    are the torch path's (which gathers, quantizes and scatters), constant rows included.

    Negative control (run): a gather kernel that writes record ``i`` at ``i * row_nbytes``
    instead of its offset fails the byte comparison."""
    from lightning_fullgraph.comm.codec import decode_rows, encode_rows

    counts = [7, 0, 12, 5]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(sum(counts), 29, generator=g) * 2
    rows[3] = 0.7  # a constant row that is not a bfloat16
    bits = torch.tensor([1, 2, 4, 8] * 6, dtype=torch.uint8)
    fast = encode_rows(rows, bits, counts, generator=torch.Generator().manual_seed(3))
    fast_rows = decode_rows(fast.buffer, bits, counts, 29)
    monkeypatch.setattr(Q, "_fused_kernels", lambda: None)
    slow = encode_rows(rows, bits, counts, generator=torch.Generator().manual_seed(3))
    assert torch.equal(fast.buffer, slow.buffer) and fast.nbytes == slow.nbytes
    assert torch.equal(fast.rng, slow.rng)
    assert torch.equal(decode_rows(slow.buffer, bits, counts, 29), fast_rows)
    assert torch.equal(fast_rows[3], rows[3])
    step = (rows.amax(1) - rows.amin(1))[:, None] * 1.02 / (2 ** bits.long()[:, None] - 1)
    assert bool(((fast_rows - rows).abs() <= step + 1e-6).all())


def test_prepare_codec_loads_the_kernels_for_cpu_messages_only(monkeypatch) -> None:
    """A quantizing policy calls ``prepare_codec`` at setup: on CPU it loads the compiled
    kernels (so no epoch compiles them) and says they will run; on another device, or
    without numba, it says the torch path will.

    Negative control (run): a ``prepare_codec`` that returns True without loading anything
    leaves the module out of ``sys.modules`` and fails."""
    loader = Q._fused_kernels
    loader.cache_clear()
    monkeypatch.delitem(sys.modules, "lightning_fullgraph.comm.fused_kernels", raising=False)
    try:
        assert Q.prepare_codec("cpu") is True
        assert "lightning_fullgraph.comm.fused_kernels" in sys.modules
        assert Q.prepare_codec("meta") is False
        monkeypatch.setattr(Q, "_fused_kernels", lambda: None)
        assert Q.prepare_codec("cpu") is False
    finally:
        loader.cache_clear()


def test_a_sum_the_kernel_leaves_half_done_is_finished_once_by_torch() -> None:
    """Accumulating, the kernel stops at a record it does not cover (an exact constant row) with
    the records before it already added; the torch path adds the rest, so every row is added
    once: the sum equals the torch backend's, repeated target rows included.

    Negative control (run): letting the torch path redo the whole call after the kernel stopped
    (the write mode's recovery) adds the first rows twice and fails."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 21, generator=g)
    x[5] = 0.1  # constant, not a bfloat16: sent in the exact constant form
    q = quantize(x, 4, generator=g)
    flat, offsets = Q._record_span(q.buffer)
    index = torch.tensor([0, 1, 0, 2, 1, 3, 0, 2, 3])
    start = torch.randn(4, 21, generator=g)
    got = Q.dequantize_scattered(flat.contiguous(), offsets, 4, 21, index, start.clone(), accumulate=True)
    want = Q.dequantize_scattered(
        flat.contiguous(), offsets, 4, 21, index, start.clone(), accumulate=True, backend="torch"
    )
    assert torch.equal(got, want)
    assert torch.equal(want, torch.index_add(start, 0, index, dequantize(q)))


def test_all_zero_rows_cost_the_encoder_no_second_pass_over_the_message() -> None:
    """All-zero rows (ReLU's, common in every hidden layer) are constant rows that need no
    exact form: after the kernel, ``quantize_scattered`` allocates only per-row vectors (at
    most 16 bytes a row: the minima and ranges, and the test for exact-form rows), never the
    message's records again; measured with the profiler's CPU allocations.

    Negative control (run): the former code, which gathered every record (through an int64
    index of the message's size) whenever any row was constant, allocated 2.57 MB here against
    57 kB (a third of the encoder's time in a py-spy profile of tolokers' adaqp bound)."""
    n, d, bits = 4096, 256, 2
    x = torch.zeros(n, d)
    x[::2] = torch.randn(n // 2, d, generator=torch.Generator().manual_seed(0))
    width = Q.row_nbytes(d, bits)
    buffer = torch.empty(n * width, dtype=torch.uint8)
    offsets = torch.arange(n) * width
    expected = Q.quantize(x, bits, key=0).buffer
    index, gen = torch.arange(n), torch.Generator()
    Q.quantize_scattered(x, index, bits, buffer, offsets, gen.manual_seed(1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        Q.quantize_scattered(x, index, bits, buffer, offsets, gen.manual_seed(1))
    allocations = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert sum(b for _, b in allocations) <= 16 * n, allocations
    zero = buffer.view(n, width)[1::2]
    assert torch.equal(zero, expected.view(n, width)[1::2])  # zero rows: the zero record

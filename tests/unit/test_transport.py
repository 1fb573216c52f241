"""The halo transport on one rank: traffic kinds, payload vs wire bits, the bound's skips."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_fullgraph.comm.messages import send_encoded, send_rows
from lightning_fullgraph.comm.plan import HaloPlan
from lightning_fullgraph.comm.quantize import META_NBYTES
from lightning_fullgraph.comm.transport import HaloTransport


def _plan() -> HaloPlan:
    # one rank, rows "sent to itself" through the counts (no process group: no collective)
    return HaloPlan(rank=0, world_size=1, num_owned=4, num_halo=4, send_index=torch.arange(4),
                    send_counts=[4], recv_counts=[4])


def test_payload_and_wire_bits_are_counted_per_direction() -> None:
    """4 rows x 16 values at 2 bits forward, fp32 backward: payload 2 and 32 bits per value;
    wire bits add 8 * META_NBYTES per row. Negative control: counting metadata in the payload
    gives 2 + 8*META_NBYTES/16 instead of 2."""
    t = HaloTransport(_plan())
    rows = torch.randn(4, 16)
    bits = torch.full((4,), 2, dtype=torch.uint8)
    out = send_encoded(t, rows, [4], [4], (bits, bits), layer=0, direction="forward")[0].wait()
    assert out.shape == rows.shape
    send_rows(t, rows, [4], [4], layer=0, direction="backward").wait()
    s = t.stats
    assert s.payload_bits["forward"] / s.values["forward"] == 2
    assert s.wire_bits["forward"] / s.values["forward"] == 2 + 8 * META_NBYTES / 16
    assert s.payload_bits["backward"] / s.values["backward"] == 32
    assert s.average_bits == (2 + 32) / 2


def test_kinds_are_counted_apart_and_the_bound_skips_only_messages() -> None:
    """One-time and control transfers are not per-epoch messages; the compute-only bound
    skips only messages (zeros come back), so degrees and control rows stay real."""
    t = HaloTransport(_plan())
    t.skip_transfers = True
    rows = torch.ones(4, 3)
    t.distributed = True  # pretend: the bound decides before any collective would be issued
    try:
        out = send_rows(t, rows, [4], [4], kind="message", layer=0).wait()
    finally:
        t.distributed = False
    assert not out.any()
    t.start(rows, [4], [4], kind="onetime").wait()
    t.control(rows, [4], [4])
    assert t.stats.bytes_sent == {"message": 48, "onetime": 48, "control": 48}
    assert "forward" in t.stats.values and t.stats.values["forward"] == 12


@pytest.mark.parametrize("encoded", [False, True])
def test_a_message_is_received_into_the_rows_it_is_given(encoded: bool) -> None:
    """With ``out`` (the halo rows of the buffer a conv reads), the transport receives, or the
    codec decodes, straight into those rows: ``wait()`` returns them, nothing is copied after.
    Under the compute-only bound the given rows come back zeroed, as a fresh buffer would.

    Negative control (run): a transport that ignores ``out`` returns a new tensor and the
    ``data_ptr`` assertion fails."""
    t = HaloTransport(_plan())
    rows = torch.randn(4, 16)
    buffer = torch.full((9, 16), -1.0)
    halo = buffer[5:]
    if encoded:
        bits = torch.full((4,), 8, dtype=torch.uint8)
        got = send_encoded(t, rows, [4], [4], (bits, bits), layer=0, out=halo)[0].wait()
    else:
        got = send_rows(t, rows, [4], [4], layer=0, out=halo).wait()
    assert got.data_ptr() == halo.data_ptr() and got.shape == halo.shape
    assert bool((buffer[:5] == -1.0).all())
    t.skip_transfers, t.distributed = True, True  # the bound decides before any collective
    try:
        send_rows(t, rows, [4], [4], layer=0, out=halo).wait()
    finally:
        t.distributed = False
    assert not halo.any()
    with pytest.raises(ValueError, match="contiguous"):
        t.start(rows, [4], [4], out=torch.empty(4, 8))


def test_the_datamodule_does_not_import_the_strategy() -> None:
    """No import cycle (the strategy imports the datamodule, not the reverse): the datamodule
    recognises the strategy by its ``trains_on_partitions`` marker.

    Negative control: the 0.1 datamodule's ``from lightning_fullgraph.strategy import
    FullGraphStrategy`` (inside ``setup``) fails the source check."""
    import ast
    import importlib.util

    from lightning_fullgraph import FullGraphStrategy

    spec = importlib.util.find_spec("lightning_fullgraph.data.datamodule")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(open(spec.origin).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "lightning_fullgraph.strategy" not in imported and "lightning_fullgraph" not in imported
    assert FullGraphStrategy.trains_on_partitions is True


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("kept", [False, True])
def test_message_buffers_die_with_their_last_reference(compressed: bool, kept: bool) -> None:
    """Once the caller drops the rows a message returned (and its closures), their memory is
    freed at once, not at the next garbage collection: no reference cycle holds the buffers.
    (At products' size every fp32 message held until a collection is hundreds of MiB per
    rank.)  Negative control: a handle that refers to itself (e.g. ``self._me = self`` in
    ``Transfer.__init__``, as the earlier closure's ``finish.received = finish`` did) keeps the
    received rows alive and fails the first case."""
    t = HaloTransport(_plan())
    rows = torch.randn(4, 16)
    bits = (torch.full((4,), 2, dtype=torch.uint8),) * 2 if compressed else None
    finish = send_encoded(t, rows, [4], [4], bits, layer=0)[0] if bits else send_rows(t, rows, [4], [4], layer=0)
    got = finish.received() if kept else finish.wait()
    ref = weakref.ref(got.buffer if hasattr(got, "buffer") else got)
    was = gc.isenabled()
    gc.disable()
    try:
        del got, finish
        assert ref() is None
    finally:
        if was:
            gc.enable()

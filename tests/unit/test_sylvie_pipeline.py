"""Sylvie's pipeline buffers: smoothing once per received block, drain-invariance, state."""

from __future__ import annotations

import pytest
import torch

from lightning_fullgraph.comm.policies.sylvie.pipeline import LayerPipe, StalenessState


def _pending(value: torch.Tensor, calls: list[int]):
    def finish() -> torch.Tensor:
        calls.append(1)
        return value

    return finish


def test_smoothing_blends_each_received_block_once_and_resets_on_sync() -> None:
    """avg <- gamma avg + (1 - gamma) received for asynchronous receipts; a synchronous receipt
    resets it. Negative control: blending on synchronous receipts too gives 0.5*1 + 0.5*3 = 2
    instead of 3 for the second block."""
    st = StalenessState(staleness=3, smoothing=0.5, smooth="both")
    pipe = LayerPipe()
    st.receive_halo(pipe, torch.full((2, 2), 1.0), 0, synchronous=True)
    st.receive_halo(pipe, torch.full((2, 2), 3.0), 1, synchronous=True)
    assert torch.equal(pipe.halo, torch.full((2, 2), 3.0))
    st.receive_halo(pipe, torch.full((2, 2), 5.0), 2, synchronous=False)
    assert torch.equal(pipe.halo, torch.full((2, 2), 4.0)) and pipe.halo_epoch == 2


def test_landing_early_for_a_checkpoint_changes_nothing() -> None:
    """Draining (what a checkpoint does) and landing later inside the step give the same
    buffers: the block is blended exactly once, whenever it lands.

    Negative control: the 0.1 rule (blend only if the block was still pending when the step
    consumed it) leaves the drained run's average at the old value."""
    results = []
    for drain_first in (False, True):
        st = StalenessState(staleness=3, smoothing=0.9, smooth="both")
        pipe = st.layer(0)
        st.receive_halo(pipe, torch.zeros(3, 2), 0, synchronous=True)
        calls: list[int] = []
        pipe.fwd_pending, pipe.fwd_epoch = _pending(torch.ones(3, 2), calls), 1
        if drain_first:
            state = st.state_dict()  # drains
            assert state["layers"][0]["halo_epoch"] == 1
        st.land_forward(pipe)  # what the next step does
        assert calls == [1]
        results.append(pipe.halo.clone())
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], torch.full((3, 2), 0.1))


def test_state_round_trip_and_abandon() -> None:
    st = StalenessState(staleness=2, smoothing=None)
    pipe = st.layer(1)
    st.receive_grad(pipe, torch.arange(6.0).view(3, 2), 4, synchronous=True)
    again = StalenessState(staleness=2)
    again.load_state_dict(st.state_dict())
    assert torch.equal(again.layer(1).grad, pipe.grad) and again.layer(1).grad_epoch == 4
    calls: list[int] = []
    pipe.grad_pending = _pending(torch.zeros(3, 2), calls)
    st.abandon()
    st.drain()
    assert calls == [] and pipe.grad_pending is None


@pytest.mark.parametrize(("kwargs", "match"), [({"staleness": 0}, "staleness"), ({"smoothing": -0.1}, "smoothing"),
                                               ({"smooth": "x"}, "smooth=")])
def test_settings_validated(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        StalenessState(**kwargs)


def _encoded(rows: torch.Tensor, bits: int = 1):
    from lightning_fullgraph.comm.codec import ReceivedRows, encode_rows

    b = torch.full((rows.size(0),), bits, dtype=torch.uint8)
    enc = encode_rows(rows, b, [rows.size(0)], generator=torch.Generator().manual_seed(0))
    return ReceivedRows(enc.buffer, b, [rows.size(0)], rows.size(1), torch.float32)


def test_encoded_blocks_decode_when_used_blend_and_checkpoint_as_rows() -> None:
    """A block kept encoded is decoded on use into a fresh tensor equal to ``decode_rows``
    at receipt; a smoothing average of two encoded blocks is their float blend; the state
    dict holds plain tensors of the same values.  Negative control: ``halo_rows`` returning
    the kept object (not a tensor) fails the equality below."""
    from lightning_fullgraph.comm.codec import decode_rows

    rows = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    block = _encoded(rows)
    want = decode_rows(block.buffer, block.bits, block.counts, block.row_len)
    st = StalenessState(staleness=3)
    pipe = st.layer(0)
    st.receive_halo(pipe, block, 0, synchronous=True)
    first, second = st.halo_rows(pipe), st.halo_rows(pipe)
    assert torch.equal(first, want) and first.data_ptr() != second.data_ptr()
    st.receive_grad(pipe, block, 0, synchronous=True)
    assert torch.equal(st.grad_rows(pipe), want)
    saved = st.state_dict()["layers"][0]
    assert isinstance(saved["halo"], torch.Tensor) and torch.equal(saved["halo"], want)

    smooth = StalenessState(staleness=3, smoothing=0.5, smooth="features")
    p = smooth.layer(0)
    other = _encoded(rows * 2)
    smooth.receive_halo(p, block, 0, synchronous=True)
    smooth.receive_halo(p, other, 1, synchronous=False)
    assert torch.equal(p.halo, 0.5 * want + 0.5 * other.decode())

r"""Sylvie's bounded-staleness pipeline (after PipeGCN): its buffers and its halo path.

The schedule (decided by :class:`~lightning_fullgraph.comm.policies.sylvie.policy.SylviePolicy`): epoch
:math:`t` is *synchronous* when :math:`t \bmod \varepsilon = 0` (epoch 0 included) or when the
epoch-adaptive rule asked for it; otherwise it is *asynchronous*.  Per layer :math:`l`, rank
:math:`r` and owner :math:`q`:

* synchronous epoch: the halo rows of this epoch's :math:`\mathbf{X}^{(l)}` are exchanged and
  waited for; in backward the halo-row gradients go home and are added at once (exact).  Both
  received blocks are kept: :math:`\mathbf{H}^{(l)}_r` (``[H, F]``) and
  :math:`\mathbf{G}^{(l)}_q` (``[S, F]``, one row per row :math:`q` sends);
* asynchronous epoch: layer :math:`l` consumes :math:`\mathbf{H}^{(l)}_r` -- received during
  epoch :math:`t-1` -- and in backward adds :math:`\mathbf{G}^{(l)}_q` (received during epoch
  :math:`t-1`) into the owners' gradients; this epoch's rows and gradients are sent in the
  background and become :math:`\mathbf{H}, \mathbf{G}` of epoch :math:`t+1`:

.. math::
    \mathbf{H}^{(l)}_r[t] = \mathrm{halo}\big(\mathbf{X}^{(l)}[t-1]\big), \qquad
    \nabla \mathbf{X}^{(l)}_q[t] \mathrel{+}= \mathrm{home}\big(\nabla \mathbf{H}^{(l)}[t-1]\big)

* an asynchronous epoch followed by a synchronous (or no) epoch sends nothing: its payload
  would be replaced by the fresh exchange.  So every transfer is consumed, and every epoch's
  update includes the remote gradient contributions of the epoch before (or of its own, when
  synchronous): no value used is more than one epoch old, and at most ``eps - 1`` consecutive
  epochs use stale values.

Optional PipeGCN smoothing (``smoothing = gamma``): the consumed halo rows and/or gradients
are exponential moving averages, updated once per *received* block: a synchronous receipt
resets the average, an asynchronous one does ``avg <- gamma * avg + (1 - gamma) * received``.
Because the update happens when a block lands -- however early it is waited for -- draining
the pipeline (to write a checkpoint) never changes what training sees.

:meth:`StalenessState.state_dict` waits for the transfers in flight and returns plain
tensors, so a checkpoint resumes bit for bit.

The halo path the policy hands the exchanger (:func:`pipeline_halo`, the protocol of
:mod:`~lightning_fullgraph.comm.path`) runs a synchronous epoch's layer through ``_KeepFn``
(the synchronous exchange, keeping both received blocks) and an asynchronous epoch's through
``_StaleFn`` (consume the kept blocks, send this epoch's when the schedule says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_fullgraph.comm.codec import ReceivedRows
from lightning_fullgraph.comm.path import Exchanger, append_halo, halo_buffer, split_halo_grad

__all__ = ["SMOOTH_CHOICES", "Block", "LayerPipe", "Schedule", "StalenessState", "block_rows", "pipeline_halo"]

SMOOTH_CHOICES: tuple[str, ...] = ("features", "gradients", "both")

#: A kept block: float rows, or a compressed message kept encoded (decoded when used).
Block = Tensor | ReceivedRows


def block_rows(block: Block) -> Tensor:
    """The rows of a kept block (decoded if it is kept encoded; the tensor itself otherwise)."""
    return block.decode() if isinstance(block, ReceivedRows) else block


@dataclass
class LayerPipe:
    """Pipeline buffers of one layer on one rank.

    A received compressed block is kept encoded (:class:`~lightning_fullgraph.comm.codec.
    ReceivedRows`, 1-bit rows: ~1/25 of the float32 memory) until it is used; a smoothing
    average is float32.

    Attributes:
        halo: ``[H, F]`` halo rows to consume next (the smoothing average when on).
        halo_epoch: Epoch in which the newest received halo block was sent.
        fwd_pending: Waits for the forward transfer in flight and returns its rows.
        fwd_epoch: Epoch in which the in-flight forward transfer was launched.
        grad: ``[S, F]`` gradients of the rows this rank sends, to add in the next backward
            (the smoothing average when on).
        grad_epoch: Epoch in which the newest received gradient block was sent.
        grad_pending, grad_pending_epoch: The gradient transfer in flight.
    """

    halo: Block | None = None
    halo_epoch: int = -1
    fwd_pending: Callable[[], Block] | None = None
    fwd_epoch: int = -1
    grad: Block | None = None
    grad_epoch: int = -1
    grad_pending: Callable[[], Block] | None = None
    grad_pending_epoch: int = -1
    #: Epoch whose backward last added :attr:`grad` (a block is added once).
    grad_added_epoch: int = -1

    def newest_halo_epoch(self) -> int:
        """Epoch of the newest halo block, landed or in flight (-1: none)."""
        return self.fwd_epoch if self.fwd_pending is not None else (self.halo_epoch if self.halo is not None else -1)

    def newest_grad_epoch(self) -> int:
        """Epoch of the newest gradient block, landed or in flight (-1: none)."""
        if self.grad_pending is not None:
            return self.grad_pending_epoch
        return self.grad_epoch if self.grad is not None else -1


@dataclass
class StalenessState:
    """Buffers of the asynchronous pipeline of one rank (the schedule lives in the policy).

    Args:
        staleness: ``eps >= 1``; every ``eps``-th epoch is synchronous (``1``: always).
        smoothing: PipeGCN momentum ``gamma`` in ``[0, 1)``, or ``None`` (off).
        smooth: What to smooth: ``"features"``, ``"gradients"`` or ``"both"``.
    """

    staleness: int = 5
    smoothing: float | None = None
    smooth: str = "both"
    epoch: int = 0
    layers: dict[int, LayerPipe] = field(default_factory=dict)
    # instrumentation: (epoch, layer, age in epochs) of every consumed halo block this epoch
    ages: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.staleness < 1:
            raise ValueError(f"staleness must be >= 1, got {self.staleness}")
        if self.smoothing is not None and not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing must lie in [0, 1), got {self.smoothing}")
        if self.smooth not in SMOOTH_CHOICES:
            raise ValueError(f"smooth={self.smooth!r}; choose one of {SMOOTH_CHOICES}")

    def layer(self, index: int) -> LayerPipe:
        return self.layers.setdefault(index, LayerPipe())

    def holds_blocks_of(self, epoch: int) -> bool:
        """Whether every layer holds (or is receiving) the halo rows and gradients sent in
        ``epoch``: what an asynchronous epoch ``epoch + 1`` may consume.  ``False`` without
        any layer (a fresh or reset pipeline)."""
        return bool(self.layers) and all(
            p.newest_halo_epoch() == epoch and p.newest_grad_epoch() == epoch for p in self.layers.values()
        )

    def check_consumable(self, pipe: LayerPipe, layer: int, what: str) -> None:
        """Refuses a block older than one epoch (the bound the policy's schedule keeps)."""
        sent = pipe.halo_epoch if what == "halo rows" else pipe.grad_epoch
        if sent not in (self.epoch - 1, self.epoch):
            raise RuntimeError(
                f"sylvie: layer {layer} would consume {what} sent in epoch {sent} at epoch {self.epoch}, "
                "beyond the one-epoch staleness bound (a schedule error: please report it)"
            )

    @staticmethod
    def check_width(pipe: LayerPipe, layer: int, width: int) -> None:
        """Refuses kept blocks of another width than the layer's message (a checkpoint
        written by a version, or with settings, that sent this layer other rows)."""
        kept = [b.shape[-1] for b in (pipe.halo, pipe.grad) if b is not None]
        if any(w != width for w in kept):
            raise RuntimeError(
                f"sylvie: layer {layer} sends rows of width {width}, but the pipeline state holds "
                f"blocks of width {kept} from the checkpoint it resumed: they were written by a run "
                "that exchanged other rows for this layer (an earlier version of lightning-fullgraph "
                "exchanged every layer's input). Resume with FullGraphStrategy(project_messages=False), "
                "or with the model and settings that wrote the checkpoint"
            )

    def begin_epoch(self, epoch: int, synchronous: bool) -> None:
        self.epoch = epoch
        self.ages.clear()
        if synchronous:
            # nothing is in flight under the policy's schedule; after a schedule change the
            # blocks land (and count) before the fresh exchange replaces them
            self.drain()

    # -- receiving ------------------------------------------------------------------------
    def _smooths(self, what: str) -> bool:
        return self.smoothing is not None and self.smooth in (what, "both")

    def _blend(self, old: Block | None, new: Block, synchronous: bool, what: str) -> Block:
        if synchronous or old is None or not self._smooths(what) or tuple(old.shape) != tuple(new.shape):
            return new
        assert self.smoothing is not None
        return block_rows(old).mul(self.smoothing).add_(block_rows(new), alpha=1.0 - self.smoothing)

    def receive_halo(self, pipe: LayerPipe, rows: Block, sent_epoch: int, synchronous: bool) -> None:
        """Keeps a received halo block (updating the average once per block)."""
        pipe.halo = self._blend(pipe.halo, rows, synchronous, "features")
        pipe.halo_epoch = sent_epoch

    def receive_grad(self, pipe: LayerPipe, rows: Block, sent_epoch: int, synchronous: bool) -> None:
        pipe.grad = self._blend(pipe.grad, rows, synchronous, "gradients")
        pipe.grad_epoch = sent_epoch

    @staticmethod
    def halo_rows(pipe: LayerPipe, out: Tensor | None = None) -> Tensor:
        """A new ``[H, F]`` tensor of the halo rows to consume (never the kept buffer), or
        those rows written into ``out`` (e.g. the halo rows of the buffer a conv reads)."""
        assert pipe.halo is not None
        if isinstance(pipe.halo, ReceivedRows):
            return pipe.halo.decode(out)
        return pipe.halo.clone() if out is None else out.copy_(pipe.halo)

    @staticmethod
    def grad_rows(pipe: LayerPipe) -> Tensor | None:
        """The ``[S, F]`` kept gradient rows (read-only), or ``None``."""
        return None if pipe.grad is None else block_rows(pipe.grad)

    def land_forward(self, pipe: LayerPipe) -> None:
        """Waits for the forward transfer in flight (if any) and keeps its rows."""
        if pipe.fwd_pending is not None:
            finish, pipe.fwd_pending = pipe.fwd_pending, None
            self.receive_halo(pipe, finish(), pipe.fwd_epoch, synchronous=False)

    def land_gradient(self, pipe: LayerPipe) -> None:
        if pipe.grad_pending is not None:
            finish, pipe.grad_pending = pipe.grad_pending, None
            self.receive_grad(pipe, finish(), pipe.grad_pending_epoch, synchronous=False)

    def drain(self) -> None:
        """Waits for every transfer in flight (values land exactly as they would later)."""
        for pipe in self.layers.values():
            self.land_forward(pipe)
            self.land_gradient(pipe)

    def abandon(self) -> None:
        """Forgets in-flight transfers without waiting (after a failure: a peer may be gone)."""
        for pipe in self.layers.values():
            pipe.fwd_pending = None
            pipe.grad_pending = None

    def record_age(self, layer: int, age: int) -> None:
        self.ages.append((self.epoch, layer, age))

    # -- checkpointing --------------------------------------------------------------------
    _KEYS = ("halo", "halo_epoch", "grad", "grad_epoch")

    def state_dict(self) -> dict[str, Any]:
        """Waits for in-flight transfers and returns tensors and counters only."""
        self.drain()

        def plain(v: Any) -> Any:  # kept-encoded blocks are saved decoded: same values
            return block_rows(v) if isinstance(v, ReceivedRows) else v

        return {
            "epoch": self.epoch,
            "layers": {i: {k: plain(getattr(p, k)) for k in self._KEYS} for i, p in self.layers.items()},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self.epoch = int(state["epoch"])
        self.layers = {}
        for i, entry in state["layers"].items():
            pipe = LayerPipe()
            for k, v in entry.items():
                if k in self._KEYS:
                    setattr(pipe, k, v.to(device) if isinstance(v, Tensor) and device is not None else v)
            self.layers[int(i)] = pipe


# --------------------------------------------------------------------------- the halo path


class Schedule(Protocol):
    """The policy's decisions for the current epoch that the path reads
    (:class:`~lightning_fullgraph.comm.policies.sylvie.policy.SylviePolicy`)."""

    #: Whether this epoch exchanges fresh rows (else: consumes the previous epoch's).
    synchronous: bool
    #: Whether this (asynchronous) epoch sends its rows and gradients for the next one.
    launch: bool


def pipeline_halo(
    exchanger: Exchanger, pipeline: StalenessState, schedule: Schedule, x: Tensor, layer: int, full: bool = False
) -> Tensor:
    """Sylvie's halo path for training layer ``layer`` (its input ``x`` needs a gradient): a
    synchronous epoch exchanges and keeps the blocks, an asynchronous one consumes the previous
    epoch's (module docstring).  The output follows :mod:`~lightning_fullgraph.comm.path`."""
    if not schedule.synchronous:
        return _StaleFn.apply(x, exchanger, pipeline, schedule, layer, full)
    return _KeepFn.apply(x, exchanger, pipeline, layer, full)


class _KeepFn(torch.autograd.Function):
    """Synchronous epoch of one layer: the exchange of the default path, whose received rows
    and gradients are also kept (as received: encoded when compressed) for the asynchronous
    epochs that follow.  With ``full`` the output is ``cat(x, halo)``."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, exchanger: Exchanger, pipeline: StalenessState, layer: int, full: bool = False
    ) -> Tensor:
        ctx.exchanger, ctx.layer, ctx.pipeline = exchanger, layer, pipeline
        ctx.full, ctx.num_owned = full, x.size(0)
        exchanger.check_rows(x)
        # kept as received (encoded when compressed) for the asynchronous epochs that follow
        block = exchanger.send_forward(x, layer).received()
        pipe = pipeline.layer(layer)
        # (float rows are this function's output: keep a detached alias, not the graph's node)
        pipeline.receive_halo(
            pipe, block.detach() if isinstance(block, Tensor) else block, pipeline.epoch, True
        )
        pipeline.record_age(layer, 0)
        if not full or isinstance(block, Tensor):
            return append_halo(x, block_rows(block), full)
        buffer, halo = halo_buffer(x, exchanger.plan.num_halo)
        block.decode(halo)  # decoded straight into the rows the conv reads
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        exchanger: Exchanger = ctx.exchanger
        exchanger.stats.backward_exchanges += 1
        grad_halo, owned = split_halo_grad(ctx, grad)
        message = exchanger.launch(grad_halo.contiguous(), ctx.layer, "backward")
        block = message.received()
        st = ctx.pipeline
        st.receive_grad(st.layer(ctx.layer), block, st.epoch, synchronous=True)
        return exchanger.add_home(block, owned), None, None, None, None


class _StaleFn(torch.autograd.Function):
    """Asynchronous epoch of one layer (module docstring): consume the halo rows received
    during the previous epoch and, unless the schedule says the next epoch will not use them,
    send this epoch's; in backward add the gradients received during the previous epoch and
    likewise send this epoch's."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, exchanger: Exchanger, st: StalenessState, schedule: Schedule, layer: int,
        full: bool = False,
    ) -> Tensor:
        pipe = st.layer(layer)
        st.land_forward(pipe)
        if pipe.halo is None:
            # no earlier block of this layer (a layer that did not run in the last
            # synchronous epoch): fetch fresh rows rather than feed zeros
            st.receive_halo(pipe, exchanger.fetch(x, layer), st.epoch, synchronous=True)
        st.check_consumable(pipe, layer, "halo rows")
        st.check_width(pipe, layer, x.size(-1))
        if schedule.launch:
            pipe.fwd_pending = exchanger.send_forward(x, layer).received
            pipe.fwd_epoch = st.epoch
        st.record_age(layer, st.epoch - pipe.halo_epoch)
        ctx.exchanger, ctx.state, ctx.schedule, ctx.layer = exchanger, st, schedule, layer
        ctx.full, ctx.num_owned = full, x.size(0)
        if not full:
            return st.halo_rows(pipe)
        buffer, halo = halo_buffer(x, exchanger.plan.num_halo)
        st.halo_rows(pipe, halo)  # decoded straight into the rows the conv reads
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        grad_halo, owned = split_halo_grad(ctx, grad)
        exchanger: Exchanger = ctx.exchanger
        st: StalenessState = ctx.state
        pipe = st.layer(ctx.layer)
        st.land_gradient(pipe)
        if pipe.grad_added_epoch == st.epoch:
            raise RuntimeError(
                f"sylvie: a second backward pass through layer {ctx.layer} in epoch {st.epoch}; an "
                "asynchronous epoch carries one gradient block per layer (each backward would add the "
                "previous epoch's block again). Back-propagate the sum of the losses in one call, or "
                "use mode='adaqp' (synchronous low-bit messages)"
            )
        pipe.grad_added_epoch = st.epoch
        stale = pipe.grad  # kept as received: decoded straight into the sum (add_home)
        if stale is not None:
            st.check_consumable(pipe, ctx.layer, "gradients")
        exchanger.stats.backward_exchanges += 1
        if ctx.schedule.launch:
            pipe.grad_pending = exchanger.launch(grad_halo.contiguous(), ctx.layer, "backward").received
            pipe.grad_pending_epoch = st.epoch
        if stale is not None:
            if isinstance(stale, Tensor):
                stale = stale.to(grad_halo.dtype)
            return exchanger.add_home(stale, owned), None, None, None, None, None
        if owned is not None:
            return owned, None, None, None, None, None
        plan = exchanger.plan
        return grad_halo.new_zeros((plan.num_owned,) + tuple(grad_halo.shape[1:])), None, None, None, None, None

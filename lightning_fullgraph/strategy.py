r"""``FullGraphStrategy``: full-graph GNN training across ranks, one graph partition per rank.

Each rank trains on the partition a :class:`~lightning_fullgraph.FullGraphDataModule` gives
it.  The strategy patches the module's PyG convs so that every message-passing layer first
fetches its halo rows from their owners (and, in backward, returns their gradients), then
synchronises weight gradients so that the update equals the one of a single process on the
whole graph:

.. math::
    \nabla_\theta \mathcal{L} = \sum_r \frac{n_r}{n}\, \nabla_\theta \mathcal{L}_r,
    \qquad \mathcal{L}_r = \frac{1}{n_r}\sum_{i \in \mathcal{T}_r} \ell_i

where :math:`\mathcal{T}_r` are rank :math:`r`'s training nodes, :math:`n_r = |\mathcal{T}_r|`
and :math:`n = \sum_r n_r`.  Each rank back-propagates :math:`(n_r/n)\,\mathcal{L}_r` (the
halo backward carries that scaling to the rows' owners) and the gradients are summed with
one all-reduce after each backward call -- only what that call added, so a gradient
accumulated over several calls (manual optimization, stepping every k-th epoch, closures) is
summed exactly once and ``p.grad`` is the single-process gradient whenever user code sees it.
DDP's wrapper is not used: its bucket all-reduces would average instead and would interleave
with halo traffic issued from autograd.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fullgraph._os import FrozenHeap
from lightning_fullgraph._warnings import ScopedWarningFilter, leafspec_filter
from lightning_fullgraph.checkpoint import CHECKPOINT_KEY, PARTITION_KEYS, gather_policy_states, reset_reason
from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.comm.policies import CompressionPolicy, PolicyEnv, resolve_policy
from lightning_fullgraph.data.validation import all_finite
from lightning_fullgraph.launch.preflight import missing_datamodule_error
from lightning_fullgraph.launch.rendezvous import RENDEZVOUS_TIMEOUT, join_process_group
from lightning_fullgraph.metrics import CommMetricsLogger
from lightning_fullgraph.nn.context import HaloContext
from lightning_fullgraph.nn.overlap import OverlapDecision, decide_overlap
from lightning_fullgraph.nn.patch import install_adapters, uninstall_adapters
from lightning_fullgraph.reporting import (
    SMALL_HALO_SHARE,
    accumulate_grad_batches_warning,
    describe_run,
    drop_ddp_only_kwargs,
    graph_figures,
    small_halo_warning,
    transformed_input_warning,
    warn_non_exact_layers,
)
from lightning_fullgraph.training import (
    LOSS_WEIGHTINGS,
    StageLogging,
    all_reduce_gradients,
    gather_node_outputs,
    global_loss_and_seconds,
    gradient_snapshot,
    loss_scale,
)

if TYPE_CHECKING:
    from lightning_fullgraph.comm.plan import LocalPartition

__all__ = ["FullGraphStrategy"]

log = logging.getLogger(__name__)


#: Lightning's default ``log_every_n_steps`` (lowered to 1: one step per epoch here).
_LIGHTNING_DEFAULT_LOG_EVERY = 50


class FullGraphStrategy(DDPStrategy):
    """Distributed full-graph training with halo exchange between partitions.

    What the halo messages carry is decided by a compression policy
    (:mod:`~lightning_fullgraph.comm.policies`), built from ``mode`` and the settings that apply
    to it, or passed in ready-made as ``policy``.

    Args:
        mode: ``"exact"`` (fp32 messages, synchronous: identical to single-process training
            up to float rounding). ``"adaqp"``: training messages (forward rows and backward
            gradients) travel stochastically quantized, unbiased, at bit-widths assigned
            adaptively (AdaQP); evaluation exchanges stay fp32. ``"sylvie"``: one-bit messages
            (``bits`` can raise it) over an asynchronous pipeline: layers consume the halo rows
            and gradients received one epoch earlier while this epoch's travel in the
            background; every ``staleness``-th epoch is synchronous.
        policy: A ready :class:`~lightning_fullgraph.comm.policies.base.CompressionPolicy` (then
            ``mode`` and the policy settings below must be left unset).
        bits: ``"adaptive"`` (adaqp default ``"adaptive"``: 8 bits until epoch ``first_assign``,
            then AdaQP's MILP every ``assign_every`` epochs; with sylvie: the same assignment
            inside the pipeline) or a fixed 1/2/4/8 (sylvie default 1; 32 sends fp32 through the
            sylvie pipeline). Not allowed in exact mode.
        staleness: Sylvie's bound ``eps >= 1`` (default 5): every ``eps``-th epoch is
            synchronous, so at most ``eps - 1`` consecutive epochs use one-epoch-old values.
        smoothing: PipeGCN momentum ``gamma`` for stale values (sylvie; ``None``: off).
        smooth: ``"features"``, ``"gradients"`` or ``"both"`` (what smoothing applies to;
            default ``"both"``).
        epoch_adaptive: Sylvie's Bounded Staleness Adaptor on the global training loss's rate
            of decrease: ``True``/``"second"`` per second (the seed), ``"epoch"`` per epoch
            (reproducible), ``"auto"`` (sylvie default: per epoch where the halo share is at or
            above ``max_halo_share``, else off), ``False`` off (see
            :class:`~lightning_fullgraph.comm.policies.sylvie.policy.SylviePolicy`).
        adaptive_window: Epochs of monotone slowdown / speed-up the adaptor waits for (default 5).
        guard: Sylvie's divergence guard (default 0.1): after an epoch on stale values, a
            global training loss above its best by more than ``guard`` times the larger of the
            best and half the first epoch's loss turns the pipeline off for
            ``guard_cooldown`` epochs, doubling each time; ``False`` turns it off.
        guard_cooldown: Synchronous epochs after the guard's first reaction (default 10).
        max_halo_share: Sylvie pipelines only while halo rows are less than this share of the
            graph's aggregation inputs (default 0.2); at or above it every epoch is synchronous at
            ``bits`` (where measured, the stale pipeline collapsed training there).
        assign_every: Epochs between bit-width re-assignments (adaptive bits; default 50).
        first_assign: Epoch of the first assignment (adaptive bits; default 5).
        lambda_: Weight of variance against time in the assignment objective, in [0, 1]
            (default 0.5).
        group_size: Rows per group sharing one bit-width in the assignment (default 100).
        link_costs: ``"measure"`` (adaptive bits: time every link at the first assignment) or
            ``"uniform"`` (the same nominal 1 GB/s, 100 us link everywhere: reproducible
            assignments, e.g. for tests); default ``"measure"``.
        seed: Seed of the stochastic rounding (rank ``r`` uses ``seed + r``; default 0).
        check_finite: Check every conv output and the loss for NaN/inf and stop with an error
            naming the rank and the layer (one reduction per layer; off saves it).
        compute_only: Benchmark bound: run this mode's own compute path (overlap split,
            quantize/dequantize, pipeline bookkeeping) with every halo collective skipped
            (received halo rows are zeros, so results are WRONG); measures what the mode costs
            without communication, the limit its transfers can approach.
        overlap: Central/marginal overlap: owned nodes without a remote in-neighbour are
            aggregated while the halo exchange is in flight (forward; in backward the halo
            gradients travel while the central part's backward runs). Exact. ``True`` forces
            it, ``False`` turns it off; default ``None``: off except in adaqp mode, where it is
            decided at setup, the same on every rank, from the central share of the aggregation
            (on where the smallest share over ranks is at least 50 %; measured,
            :mod:`~lightning_fullgraph.nn.overlap`); the fit-start line and
            :attr:`overlap_decision` say what was decided and why. Applies to GCN, SAGE, GIN
            and GraphConv layers (GAT layers always run synchronously).
        sparse_aggregation: Aggregate through cached CSR adjacencies of the local graph
            (PyG's fused ``message_and_aggregate`` path, ``torch.sparse.mm``) for GCN, SAGE,
            GIN and GraphConv layers; ``False`` keeps PyG's edge-list path (an ``[E_r, F]``
            message tensor per layer). Exact either way; GAT and GINE always use edges.
        project_messages: Let a GCN or SAGE layer that narrows the rows (``F_out < F_in``,
            e.g. the output layer) exchange its projected rows ``X W`` instead of its input
            ``X`` where that is fewer values per halo row, counting the gradient that comes
            back (:meth:`~lightning_fullgraph.nn.context.HaloContext.sends_projection`; the
            batch's static features always travel as themselves, once). Exact: the layer
            computes the same matrix; the compressed modes quantize (Sylvie: keep) the rows
            that travel. ``False`` (default ``True``): every layer exchanges its input, as the
            AdaQP and PipeGCN/Sylvie codes do, and as earlier versions of this package did
            (resume a Sylvie checkpoint they wrote mid-pipeline with ``False``).
        loss_weighting: How per-rank losses combine into the global gradient.
            ``"train_mask"`` (default): the module's loss is a mean over the rank's nodes in
            ``batch.<mask_key>``; ranks are weighted by their share of those nodes, giving the
            gradient of the global mean. ``"mean"``: plain average over ranks (DDP's rule).
            ``"sum"``: the module already returns its share of a global loss; gradients are
            summed.
        mask_key: Node mask that defines the training nodes for ``"train_mask"`` weighting.
        timeout: Process-group timeout; a rank that dies makes the others fail after it.
        rendezvous_timeout: How long the ranks may take to start and meet (default 10 min,
            torchrun's); the start is not a collective, so a short ``timeout`` does not bound
            it (the longer of the two does: :mod:`lightning_fullgraph.launch.rendezvous`).
        start_method: ``"popen"`` (default, scripts and CLI), ``"fork"``, ``"spawn"``, ...
            With several ranks, SIGTERM/SIGINT stop every rank within seconds (status
            ``128 + signum``) and no rank outlives its launcher (:mod:`lightning_fullgraph.launch`).
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); inferred by default.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (accelerator,
            parallel_devices, cluster_environment, checkpoint_io, precision_plugin).

    A rank that owns no training node contributes a loss of exactly 0 (weight ``n_r / n =
    0``), still exchanges rows and gradients, and counts 0 in the global loss the
    epoch-adaptive rule reads.
    """

    strategy_name = "fullgraph_quant"
    #: Marks a strategy that trains on graph partitions (checked by the datamodule).
    trains_on_partitions = True

    def __init__(
        self,
        mode: Literal["exact", "adaqp", "sylvie"] | None = None,
        policy: CompressionPolicy | None = None,
        bits: int | str | None = None,
        staleness: int | None = None,
        smoothing: float | None = None,
        smooth: Literal["features", "gradients", "both"] | None = None,
        epoch_adaptive: bool | Literal["second", "epoch", "auto"] | None = None,
        adaptive_window: int | None = None,
        guard: float | bool | None = None,
        guard_cooldown: int | None = None,
        max_halo_share: float | None = None,
        assign_every: int | None = None,
        first_assign: int | None = None,
        lambda_: float | None = None,
        group_size: int | None = None,
        link_costs: Literal["measure", "uniform"] | None = None,
        seed: int | None = None,
        overlap: bool | None = None,
        compute_only: bool = False,
        check_finite: bool = True,
        sparse_aggregation: bool = True,
        project_messages: bool = True,
        loss_weighting: Literal["train_mask", "mean", "sum"] = "train_mask",
        mask_key: str = "train_mask",
        timeout: timedelta | None = default_pg_timeout,
        rendezvous_timeout: timedelta | None = RENDEZVOUS_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        settings = {
            "bits": bits, "staleness": staleness, "smoothing": smoothing, "smooth": smooth,
            "epoch_adaptive": epoch_adaptive, "adaptive_window": adaptive_window,
            "guard": guard, "guard_cooldown": guard_cooldown, "max_halo_share": max_halo_share,
            "assign_every": assign_every, "first_assign": first_assign, "lambda_": lambda_,
            "group_size": group_size, "link_costs": link_costs, "seed": seed,
        }
        policy = resolve_policy(mode, policy, **settings)
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={loss_weighting!r}; choose one of {LOSS_WEIGHTINGS}")
        drop_ddp_only_kwargs(kwargs)
        super().__init__(
            timeout=timeout, start_method=start_method, process_group_backend=process_group_backend, **kwargs
        )
        self.policy: CompressionPolicy = policy
        self.overlap_setting = overlap
        #: Whether the split runs, the central share and why (set at setup; nn/overlap.py).
        self.overlap_decision: OverlapDecision | None = None
        self.compute_only = compute_only
        self.check_finite = check_finite
        self.sparse_aggregation = bool(sparse_aggregation)
        self.project_messages = bool(project_messages)
        self.rendezvous_timeout = rendezvous_timeout
        self.loss_weighting = loss_weighting
        self.mask_key = mask_key
        self._failed = False
        self._step_loss: Tensor | None = None
        self._pending_state: dict[str, Any] | None = None
        self._halo_group: Any = None
        self._exchanger: HaloExchanger | None = None
        self._ctx: HaloContext | None = None
        self._adapters: Any = None
        self._loss_scale: float = 1.0
        self._partition: LocalPartition | None = None
        self._partition_id: dict[str, Any] = {}
        self._in_step = False
        self._step_started = 0.0
        self._grads_before: dict[Tensor, Tensor | None] | None = None
        self._logging = StageLogging()
        # per rank: owned rows, halo rows, edges from halo rows, edges (set at setup)
        self._rank_figures = torch.zeros(1, 4, dtype=torch.float64)
        # one-time bytes (sent, received) counted when the last training step ended
        self._onetime_at_step_end = (0, 0)
        self._warned_input = False
        self._epochs_run = 0
        #: Halo rows' share of the aggregation inputs of the whole graph (set at setup).
        self.halo_share = 0.0
        #: Figures of the last training step's policy decisions (assignment time, global
        #: loss...), read by the metrics callback.
        self.step_figures: dict[str, float] = {}
        self._comm_callback = CommMetricsLogger()
        # The comm/* figures are summed over ranks with one all-reduce before logging;
        # Lightning's advice to pass sync_dist=True (one all-reduce per metric) does not apply
        # to them. Lightning warns at epoch end, so the filter spans setup..teardown.
        self._comm_warning = ScopedWarningFilter(r".*self\.log\('comm/.*sync_dist=True")
        self._leafspec_warning = leafspec_filter()
        self._frozen_heap = FrozenHeap()

    @property
    def mode(self) -> str:
        """The policy's method: ``"exact"``, ``"adaqp"`` or ``"sylvie"``."""
        return self.policy.name

    @property
    def overlap(self) -> bool | None:
        """Whether the overlap split runs: the decision once set up; before, the setting
        (``None``: decided at setup from the central share, :mod:`~lightning_fullgraph.nn.overlap`)."""
        return self.overlap_setting if self.overlap_decision is None else self.overlap_decision.used

    @property
    def bits(self) -> int | str | None:
        return getattr(self.policy, "bits", None)

    @property
    def staleness(self) -> int | None:
        return getattr(self.policy, "staleness", None)

    # -- lifecycle ------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank's dataloader yields its own partition: no sample splitting.
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup_distributed(self) -> None:
        # Lightning's own connection (``_init_dist_connection``) would bound the ranks' start
        # by ``timeout``; joined here first, Lightning finds the group initialised.
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        join_process_group(
            self.cluster_environment, self._process_group_backend, self._timeout, self.rendezvous_timeout, device_id
        )
        super().setup_distributed()
        if self.world_size > 1:
            # Halo traffic on its own communicator, created in the same order on every rank.
            self._halo_group = dist.new_group(backend=self._process_group_backend, timeout=self._timeout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning_fullgraph.data.datamodule import FullGraphDataModule

        datamodule = trainer.datamodule
        if not isinstance(datamodule, FullGraphDataModule):
            # (normally found by the launcher already: lightning_fullgraph.launch.preflight)
            raise missing_datamodule_error(datamodule)
        partition = datamodule.local_partition
        if partition is None:
            raise RuntimeError("FullGraphDataModule.setup() did not run on this rank")
        if partition.plan.world_size != self.world_size or partition.plan.rank != self.global_rank:
            raise ValueError(
                f"rank {self.global_rank} of {self.world_size} got part {partition.plan.rank} of "
                f"{partition.plan.world_size}; partition the graph into as many parts as ranks"
            )
        self._partition = partition
        manifest = datamodule.manifest
        self._partition_id = {k: manifest.get(k) for k in PARTITION_KEYS}
        datamodule.move_to(self.root_device)
        plan = partition.plan.to(self.root_device)
        self._exchanger = HaloExchanger(plan, group=self._halo_group, policy=self.policy)
        self._exchanger.skip_transfers = self.compute_only
        self._onetime_at_step_end = (0, 0)
        self._warned_input = False
        for key in partition.data.keys():
            value = partition.data[key]
            if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == plan.num_owned:
                self._exchanger.register_static(value)
        self.halo_share, self._rank_figures = graph_figures(partition, self.world_size, self.root_device)
        self.overlap_decision = decide_overlap(
            self.overlap_setting, self.policy, partition, self.world_size, self.root_device
        )
        self._logging.setup(partition, self.world_size, self.root_device)
        fitting = trainer.state.fn == TrainerFn.FITTING
        max_epochs = trainer.max_epochs if fitting else None
        self.policy.setup(
            PolicyEnv(
                plan=plan,
                group=self._halo_group,
                device=self.root_device,
                control=self._exchanger.transport.control,
                fitting=fitting,
                final_epoch=max_epochs - 1 if max_epochs is not None and max_epochs >= 0 else None,
                halo_share=self.halo_share,
                compute_only=self.compute_only,
            )
        )
        if self._pending_state is not None:
            self._restore_policy_state(self._pending_state)
        self._pending_state = None
        self._ctx = HaloContext(
            self._exchanger,
            overlap=self.overlap_decision.used,
            check_finite=self.check_finite,
            sparse=self.sparse_aggregation,
            project=self.project_messages,
        )
        assert self.lightning_module is not None
        if self._adapters is not None:
            uninstall_adapters(self._adapters)
        self._adapters = install_adapters(self.lightning_module, self._ctx)
        warn_non_exact_layers(self.lightning_module)
        if fitting:
            self._loss_scale = loss_scale(partition, self.loss_weighting, self.mask_key, self.world_size, self.root_device)
            accumulating = accumulate_grad_batches_warning(trainer.accumulate_grad_batches)
            if accumulating is not None:
                rank_zero_warn(accumulating)
            if trainer.log_every_n_steps == _LIGHTNING_DEFAULT_LOG_EVERY:
                # One optimizer step per epoch: Lightning's default of 50 steps would log the
                # training metrics once every 50 epochs (none at all in a 50-epoch run).
                trainer.log_every_n_steps = 1
        if fitting:
            rank_zero_info(self.describe_run())
            small = small_halo_warning(self.policy.name, self.halo_share, self.world_size)
            if small is not None:
                rank_zero_warn(small)
        self._comm_warning.install()
        self._leafspec_warning.install()
        if self._comm_callback not in trainer.callbacks:
            trainer.callbacks.append(self._comm_callback)
        super().setup(trainer)
        # last, so that what setup built is frozen too (lightning_fullgraph._os.FrozenHeap)
        self._frozen_heap.install()

    def describe_run(self) -> str:
        """The fit-start line: mode and settings, graph, parts, halo rows per rank and their
        share of the aggregation inputs (:func:`~lightning_fullgraph.reporting.describe_run`)."""
        return describe_run(self.policy, self._rank_figures, self.halo_share, self.overlap_decision)

    #: Below this share of the aggregation inputs, compressing halo messages cannot matter.
    SMALL_HALO_SHARE = SMALL_HALO_SHARE

    @override
    def configure_ddp(self) -> None:
        # No DDP wrapper (see module docstring); start every rank from rank 0's weights.
        assert self.model is not None
        from lightning_fullgraph.launch.launchers import sync_module_states

        sync_module_states(self.model)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        exchanger = self._exchanger
        if exchanger is not None:
            assert self.lightning_module is not None
            # one-time transfers outside training (the sanity check, validation) count toward
            # this step's comm/onetime_bytes instead of vanishing with the reset
            stats = exchanger.stats
            carried = (
                stats.bytes_sent["onetime"] - self._onetime_at_step_end[0],
                stats.bytes_recv["onetime"] - self._onetime_at_step_end[1],
            )
            stats.reset()
            stats.bytes_sent["onetime"], stats.bytes_recv["onetime"] = carried
            self._step_loss = None
            epoch = self.lightning_module.current_epoch
            # the policy's decisions for this epoch (may be collective: every rank is here)
            self.step_figures = dict(self.policy.on_train_epoch_start(epoch))
            exchanger.begin_step(training=True)
            self._in_step = True
            self._step_started = time.perf_counter()
        self._logging.begin(self._results(), self._partition, "train_mask")
        try:
            out = super().training_step(*args, **kwargs)
        finally:
            self._logging.end()
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            # every backward call of the step has run
            self._end_training_step()
        self._logging.forget_empty(self._results(), "train_mask")
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._logging.begin(self._results(), self._partition, "val_mask")
        try:
            return super().validation_step(*args, **kwargs)
        finally:
            self._logging.end()
            self._logging.forget_empty(self._results(), "val_mask")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._logging.begin(self._results(), self._partition, "test_mask")
        try:
            return super().test_step(*args, **kwargs)
        finally:
            self._logging.end()
            self._logging.forget_empty(self._results(), "test_mask")

    def _results(self) -> Any:
        """Lightning's ``trainer._results`` (what ``self.log`` accumulates into), or ``None``."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return getattr(trainer, "_results", None) if trainer is not None else None

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean"
    ) -> Tensor | Any:
        """Lightning's reduction (``self.log(..., sync_dist=True)``, ``strategy.reduce``), with
        two corrections to a mean over ranks:

        * inside a step whose stage has a rank without nodes (the same on every rank;
          :class:`~lightning_fullgraph.training.StageLogging`), the ranks without nodes are
          left out -- their value, a mean over no node, is meaningless (NaN for a loss):
          ``sum_r has_r x_r / sum_r has_r``;
        * an integer tensor's mean is a float (Lightning's divides in place and floors: the
          summed batch sizes 21 + 0 of an epoch mean became 10, not 10.5, skewing the
          weighted epoch value).
        """
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        corrected = self._logging.mean(tensor, group, self.world_size, mean)
        if corrected is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        return corrected

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self._loss_scale == 0:
            # A rank without training nodes: its share of the global loss is exactly 0 (its
            # mean over no node may be NaN, and NaN * 0 is NaN); backward still runs, so it
            # keeps sending halo gradients (zeros of its own loss, others' contributions).
            scaled = closure_loss.nan_to_num(0.0) * 0.0
        else:
            if self.check_finite and not all_finite(closure_loss):
                raise FloatingPointError(
                    f"rank {self.global_rank}: the training loss is {float(closure_loss)} at epoch "
                    f"{self.lightning_module.current_epoch if self.lightning_module else '?'}; every layer "
                    "output was finite, so the loss computation itself produced it"
                )
            scaled = closure_loss * self._loss_scale
        # a step may call backward several times (manual optimization): its loss is the sum
        self._step_loss = scaled.detach() if self._step_loss is None else self._step_loss + scaled.detach()
        self._grads_before = self._gradient_snapshot() if self.world_size > 1 else None
        super().backward(scaled, optimizer, *args, **kwargs)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.world_size > 1:
            self._all_reduce_gradients(self._grads_before)
        self._grads_before = None
        module = self.lightning_module
        if module is not None and module.automatic_optimization:
            # (manual optimization: the step may call backward again; it ends in training_step)
            self._end_training_step()

    def _end_training_step(self) -> None:
        """The step's last backward ran: hand the policy the epoch's global loss and time."""
        if self._exchanger is not None and self._in_step:
            self._in_step = False
            self._exchanger.begin_step(training=False)
            stats = self._exchanger.stats
            self._onetime_at_step_end = (stats.bytes_sent["onetime"], stats.bytes_recv["onetime"])
            self._warn_transformed_input()
            assert self.lightning_module is not None
            loss = seconds = None
            if self.policy.needs_global_loss and self._step_loss is not None:
                elapsed = time.perf_counter() - self._step_started
                loss, seconds = global_loss_and_seconds(self._step_loss, elapsed, self.world_size, self.root_device)
            epoch = self.lightning_module.current_epoch
            self.step_figures.update(self.policy.on_train_epoch_end(epoch, loss, seconds))
            self._epochs_run = epoch + 1

    def _warn_transformed_input(self) -> None:
        """Once per fit (:func:`~lightning_fullgraph.reporting.transformed_input_warning`)."""
        exchanger = self._exchanger
        if exchanger is None or exchanger.transformed_input is None or self._warned_input:
            return
        self._warned_input = True
        message = transformed_input_warning(exchanger)
        if message is not None:
            rank_zero_warn(message)

    def _gradient_snapshot(self) -> dict[Tensor, Tensor | None]:
        assert self.lightning_module is not None
        return gradient_snapshot(self.lightning_module)

    def _all_reduce_gradients(self, before: dict[Tensor, Tensor | None] | None = None) -> None:
        """Sums over ranks what the backward call that just ran added to every gradient
        (:func:`~lightning_fullgraph.training.all_reduce_gradients`)."""
        assert self.lightning_module is not None
        all_reduce_gradients(self.lightning_module, before, self.root_device, self.check_finite, self.global_rank)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().predict_step(*args, **kwargs)
        return self.gather_node_outputs(out)

    def gather_node_outputs(self, out: Any) -> Any:
        """Assembles per-rank node outputs into the global node order
        (:func:`~lightning_fullgraph.training.gather_node_outputs`)."""
        assert self._partition is not None
        return gather_node_outputs(out, self._partition, self.world_size, self.root_device)

    @override
    def teardown(self) -> None:
        from lightning_fullgraph.launch.guard import active_guard

        guard = active_guard()
        signalled = guard is not None and guard.signum is not None
        try:
            # after SIGTERM/SIGINT a peer may be gone: forget transfers in flight, never wait
            self.policy.teardown(failed=self._failed or signalled)
            if self._epochs_run and not (self._failed or signalled):
                totals = self._comm_callback.totals.summary(self.policy.name)
                if totals is not None:
                    rank_zero_info(totals)
                summary = self.policy.summary(self._epochs_run)
                if summary is not None:
                    rank_zero_warn(summary)
            self._epochs_run = 0
            if self._adapters is not None:
                uninstall_adapters(self._adapters)
                self._adapters = None
            if self._exchanger is not None:
                self._exchanger.clear_cache()
            self._comm_warning.remove()
            self._leafspec_warning.remove()
            self._frozen_heap.remove()
            super().teardown()
        finally:
            if guard is not None:
                # a signalled rank ends here (status 128 + signum), after Lightning's exception
                # path ran, instead of in interpreter shutdown behind in-flight collectives
                guard.finish_if_signalled()

    @override
    def on_exception(self, exception: BaseException) -> None:
        from lightning_fullgraph.launch.guard import active_guard
        from lightning_fullgraph.launch.report import claim_report, explain_lost_peer, is_lost_peer

        self._failed = True
        super().on_exception(exception)
        guard = active_guard()
        if guard is not None and guard.signum is not None:
            return  # stopped by a signal: a peer's closed connection is not the cause
        if not claim_report(exception, self.global_rank):
            # the rank that found the error reports it (popen runs): this one, whose peer
            # stopped because of it (or which raised the same error), ends quietly
            return
        if getattr(self, "_exchange_started", None) is False:
            # failed before any loop (setup, configuration): no halo exchange to blame.  (In
            # the parent of forked ranks the flag is unknown: their error is augmented as before.)
            return
        if is_lost_peer(exception):
            explain_lost_peer(exception)

    # -- launch and shutdown (lightning_fullgraph.launch) ----------------------------------
    @override
    def _configure_launcher(self) -> None:
        # Lightning's launchers, plus: SIGTERM/SIGINT stop every rank within seconds with
        # status 128 + signum, and no rank outlives the launcher or a failed run.
        from lightning_fullgraph.launch.launchers import (
            FullGraphMultiprocessingLauncher,
            FullGraphSubprocessLauncher,
        )

        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = FullGraphSubprocessLauncher(
                self, self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = FullGraphMultiprocessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        self._exchange_started = False
        super().setup_environment()

    def _entering_loop(self) -> None:
        """A loop starts: halo exchanges follow.  Lightning installed its SIGTERM handler (it
        broadcasts, which deadlocks against a halo transfer) after the launcher installed the
        shutdown guard's: put the guard's back."""
        from lightning_fullgraph.launch.guard import active_guard

        self._exchange_started = True
        guard = active_guard()
        if guard is not None:
            guard.reassert()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._entering_loop()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._entering_loop()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._entering_loop()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._entering_loop()

    # -- checkpointing --------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        # Called on every rank (only rank 0 writes): gather every rank's policy state into it.
        # Draining the pipeline here only waits earlier for blocks training would wait for
        # anyway; what training sees does not change (comm/staleness.py).
        if self._exchanger is not None:
            checkpoint[CHECKPOINT_KEY] = gather_policy_states(
                self.policy.state_dict(), self.global_rank, self.world_size, self._partition_id
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry:
            # checked against this run's world size and partitions in setup, once they are known
            self._pending_state = entry
            if self._exchanger is not None:
                self._restore_policy_state(entry)
        return checkpoint

    def _restore_policy_state(self, entry: dict[str, Any]) -> None:
        """Loads this rank's policy state from a checkpoint entry, or resets it (and says so)
        when the checkpoint was written by another number of ranks or other partitions: the
        per-rank state (stale halo buffers, per-row bit-widths, rounding streams) belongs to
        rows this rank no longer owns.  Model and optimizer state are restored either way."""
        self._pending_state = None
        reason = reset_reason(entry, self.world_size, self._partition_id)
        if reason is not None:
            rank_zero_warn(
                f"Resuming: {reason}. Model and optimizer state are restored; the {self.policy.name} "
                "compression state (stale halo buffers, bit-widths, rounding streams) is reset, so "
                "training continues from there as a fresh run of this mode would."
            )
            return
        ranks = entry.get("ranks", [])
        mine = ranks[self.global_rank] if self.global_rank < len(ranks) else None
        if mine:
            self.policy.load_state_dict(mine)

    # -- introspection --------------------------------------------------------------------
    @property
    def exchanger(self) -> HaloExchanger | None:
        """The halo exchanger of this rank (``None`` before setup)."""
        return self._exchanger

    @property
    def loss_scale(self) -> float:
        """Factor this rank's loss is multiplied by before backward."""
        return self._loss_scale

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Registration happens in `lightning_fullgraph.__init__` (Lightning only auto-registers
        # its own classes).
        return None


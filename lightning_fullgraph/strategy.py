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
one all-reduce.  DDP's wrapper is not used: its bucket all-reduces would average instead and
would interleave with halo traffic issued from autograd.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fullgraph._warnings import ScopedWarningFilter
from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.nn.adapters import HaloContext, install_adapters, uninstall_adapters

if TYPE_CHECKING:
    from lightning_fullgraph.partition.plan import LocalPartition

__all__ = ["FullGraphStrategy", "MODES"]

log = logging.getLogger(__name__)


MODES = ("exact", "adaqp", "sylvie")
LOSS_WEIGHTINGS = ("train_mask", "mean", "sum")


class FullGraphStrategy(DDPStrategy):
    """Distributed full-graph training with halo exchange between partitions.

    Args:
        mode: ``"exact"`` (fp32 messages, synchronous: identical to single-process training
            up to float rounding). ``"adaqp"``: training messages (forward rows and backward
            gradients) travel stochastically quantized, unbiased, at bit-widths assigned
            adaptively (AdaQP); evaluation exchanges stay fp32. ``"sylvie"``: one-bit messages
            (``bits`` can raise it) over an asynchronous pipeline: layers consume the halo rows
            and gradients sent one epoch earlier while this epoch's travel in the background;
            every ``staleness``-th epoch is synchronous.
        bits: ``"adaptive"`` (adaqp default: uniform 8 bits until the first assignment, then
            AdaQP's MILP every ``assign_every`` epochs) or a fixed 1/2/4/8 (sylvie default 1;
            32 sends fp32 through the sylvie pipeline). Must be ``None`` in exact mode.
        staleness: Sylvie's bound ``eps >= 1``: every ``eps``-th epoch is synchronous, so no
            halo value or gradient used is more than ``eps - 1`` epochs old.
        smoothing: PipeGCN momentum ``gamma`` for stale values (sylvie; ``None``: off).
        smooth: ``"features"``, ``"gradients"`` or ``"both"`` (what smoothing applies to).
        epoch_adaptive: Sylvie's epoch-adaptive rule: when the global training loss stalls
            (improves by less than ``adaptive_tolerance`` relative), double the bits (up to 8)
            and go synchronous; when it improves, halve them (down to 1) and go asynchronous.
        adaptive_tolerance: Relative loss improvement below which the loss counts as stalled.
        check_finite: Check every conv output and the loss for NaN/inf and stop with an error
            naming the rank and the layer (one reduction per layer; off saves it).
        compute_only: Benchmark bound: run this mode's own compute path (overlap split,
            quantize/dequantize, pipeline bookkeeping) with every halo collective skipped
            (received halo rows are zeros, so results are WRONG); measures what the mode costs
            without communication, the limit its transfers can approach.
        link_costs: ``"measure"`` (adaptive adaqp: time sends on every link at setup) or
            ``"uniform"`` (the same nominal 1 GB/s, 100 us link everywhere: reproducible
            assignments, e.g. for tests).
        assign_every: Epochs between bit-width re-assignments (adaptive).
        lambda_: Weight of variance against time in the assignment objective, in [0, 1].
        group_size: Rows per group sharing one bit-width in the assignment.
        seed: Seed of the stochastic rounding (rank ``r`` uses ``seed + r``).
        overlap: Central/marginal overlap: owned nodes without a remote in-neighbour are
            aggregated while the halo exchange is in flight (forward; in backward the halo
            gradients travel while the central part's backward runs). Exact. Default: on in
            adaqp mode, off in exact mode. Applies to GCN, SAGE, GIN and GraphConv layers
            (GAT layers always run synchronously).
        sparse_aggregation: Aggregate through cached CSR adjacencies of the local graph
            (PyG's fused ``message_and_aggregate`` path, ``torch.sparse.mm``) for GCN, SAGE,
            GIN and GraphConv layers; ``False`` keeps PyG's edge-list path (an ``[E_r, F]``
            message tensor per layer). Exact either way; GAT and GINE always use edges.
        loss_weighting: How per-rank losses combine into the global gradient.
            ``"train_mask"`` (default): the module's loss is a mean over the rank's nodes in
            ``batch.<mask_key>``; ranks are weighted by their share of those nodes, giving the
            gradient of the global mean. ``"mean"``: plain average over ranks (DDP's rule).
            ``"sum"``: the module already returns its share of a global loss; gradients are
            summed.
        mask_key: Node mask that defines the training nodes for ``"train_mask"`` weighting.
        timeout: Process-group timeout; a rank that dies makes the others fail after it.
        start_method: ``"popen"`` (default, scripts and CLI), ``"fork"``, ``"spawn"``, ...
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); inferred by default.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (accelerator,
            parallel_devices, cluster_environment, checkpoint_io, precision_plugin).
    """

    strategy_name = "fullgraph_quant"

    def __init__(
        self,
        mode: Literal["exact", "adaqp", "sylvie"] = "exact",
        bits: int | str | None = None,
        assign_every: int = 50,
        lambda_: float = 0.5,
        group_size: int = 100,
        seed: int = 0,
        overlap: bool | None = None,
        staleness: int = 5,
        smoothing: float | None = None,
        smooth: Literal["features", "gradients", "both"] = "both",
        epoch_adaptive: bool = False,
        adaptive_tolerance: float = 1e-3,
        link_costs: Literal["measure", "uniform"] = "measure",
        compute_only: bool = False,
        check_finite: bool = True,
        sparse_aggregation: bool = True,
        loss_weighting: Literal["train_mask", "mean", "sum"] = "train_mask",
        mask_key: str = "train_mask",
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"FullGraphStrategy(mode={mode!r}) is not a mode; choose one of {MODES}")
        if mode == "sylvie":
            bits = 1 if bits is None else bits
            if bits not in (1, 2, 4, 8, 32):
                raise ValueError(f"bits={bits!r}; sylvie mode takes 1, 2, 4, 8 or 32")
            if staleness < 1:
                raise ValueError(f"staleness must be >= 1, got {staleness}")
            if smoothing is not None and not 0.0 <= smoothing < 1.0:
                raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}")
        if mode == "exact" and bits is not None:
            raise ValueError("mode='exact' sends fp32; drop `bits` or use mode='adaqp'")
        if mode == "adaqp":
            bits = "adaptive" if bits is None else bits
            if bits != "adaptive" and bits not in (1, 2, 4, 8):
                raise ValueError(f"bits={bits!r}; use 'adaptive' or one of 1, 2, 4, 8")
        if assign_every < 1 or group_size < 1:
            raise ValueError("assign_every and group_size must be >= 1")
        if not 0.0 <= lambda_ <= 1.0:
            raise ValueError(f"lambda_ must lie in [0, 1], got {lambda_}")
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={loss_weighting!r}; choose one of {LOSS_WEIGHTINGS}")
        ddp_only = {"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb"}
        ignored = {key: kwargs.pop(key) for key in sorted(ddp_only & kwargs.keys())}
        # (config systems pass DDP's defaults along; only a value someone chose is worth a warning)
        chosen = [key for key, value in ignored.items() if value not in (None, False, 25)]
        if chosen:
            rank_zero_warn(f"FullGraphStrategy does not wrap the model in DDP; ignoring {chosen}")
        super().__init__(
            timeout=timeout, start_method=start_method, process_group_backend=process_group_backend, **kwargs
        )
        self.mode = mode
        self.bits = bits
        self.assign_every = assign_every
        self.lambda_ = lambda_
        self.group_size = group_size
        self.seed = seed
        self.overlap = (mode == "adaqp") if overlap is None else bool(overlap)
        self.staleness = staleness
        self.smoothing = smoothing
        self.smooth = smooth
        self.epoch_adaptive = epoch_adaptive
        self.adaptive_tolerance = adaptive_tolerance
        if link_costs not in ("measure", "uniform"):
            raise ValueError(f"link_costs={link_costs!r}; choose 'measure' or 'uniform'")
        self.link_cost_source = link_costs
        self.compute_only = compute_only
        self.check_finite = check_finite
        self.sparse_aggregation = bool(sparse_aggregation)
        self._failed = False
        self._step_loss: Tensor | None = None
        self._last_loss: float | None = None
        self._pending_state: dict[str, Any] | None = None
        self._link_costs: dict | None = None
        self._send_weights: Tensor | None = None
        self.loss_weighting = loss_weighting
        self.mask_key = mask_key
        self._halo_group: Any = None
        self._exchanger: HaloExchanger | None = None
        self._ctx: HaloContext | None = None
        self._patched: list = []
        self._loss_scale: float = 1.0
        self._partition: LocalPartition | None = None
        self._comm_callback = _CommMetricsLogger(self)
        # The comm/* figures are summed over ranks with one all-reduce before logging;
        # Lightning's advice to pass sync_dist=True (one all-reduce per metric) does not apply
        # to them. Lightning warns at epoch end, so the filter spans setup..teardown.
        self._comm_warning = ScopedWarningFilter(r".*self\.log\('comm/.*sync_dist=True")

    # -- lifecycle ------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank's dataloader yields its own partition: no sample splitting.
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        if self.world_size > 1:
            # Halo traffic on its own communicator, created in the same order on every rank.
            self._halo_group = dist.new_group(backend=self._process_group_backend, timeout=self._timeout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning_fullgraph.datamodule import FullGraphDataModule

        datamodule = trainer.datamodule
        if not isinstance(datamodule, FullGraphDataModule):
            raise TypeError(
                "FullGraphStrategy trains on graph partitions and needs a FullGraphDataModule: "
                "call `trainer.fit(model, datamodule=FullGraphDataModule(data))` (got "
                f"{type(datamodule).__name__ if datamodule is not None else 'no datamodule'})"
            )
        partition = datamodule.local_partition
        if partition is None:
            raise RuntimeError("FullGraphDataModule.setup() did not run on this rank")
        if partition.plan.world_size != self.world_size or partition.plan.rank != self.global_rank:
            raise ValueError(
                f"rank {self.global_rank} of {self.world_size} got part {partition.plan.rank} of "
                f"{partition.plan.world_size}; partition the graph into as many parts as ranks"
            )
        self._partition = partition
        datamodule.move_to(self.root_device)
        plan = partition.plan.to(self.root_device)
        generator = torch.Generator(device=self.root_device).manual_seed(self.seed + self.global_rank)
        uniform_bits = None if self.bits is None else (8 if self.bits == "adaptive" else int(self.bits))
        self._exchanger = HaloExchanger(plan, group=self._halo_group, bits=uniform_bits, generator=generator)
        self._exchanger.skip_transfers = self.compute_only
        for key in partition.data.keys():
            value = partition.data[key]
            if isinstance(value, Tensor) and value.dim() > 0 and value.size(0) == plan.num_owned:
                self._exchanger.register_static(value)
        if self.mode == "sylvie":
            from lightning_fullgraph.comm.staleness import StalenessState

            self._exchanger.staleness = StalenessState(self.staleness, self.smoothing, self.smooth)
        self._ctx = HaloContext(
            self._exchanger, overlap=self.overlap, check_finite=self.check_finite, sparse=self.sparse_aggregation
        )
        if self.bits == "adaptive" and trainer.state.fn == TrainerFn.FITTING and self.world_size > 1:
            from lightning_fullgraph.comm.adaptive import measure_link_costs, receiver_weights

            if self.link_cost_source == "uniform":
                from lightning_fullgraph.comm.assign import LinkCost

                w = self.world_size
                self._link_costs = {
                    (a, b): LinkCost(1e-9, 1e-4) for a in range(w) for b in range(w) if a != b
                }
            else:
                self._link_costs = measure_link_costs(self._halo_group, self.global_rank, self.world_size)
            self._send_weights = receiver_weights(self._exchanger, partition.data.edge_index)
        assert self.lightning_module is not None
        uninstall_adapters(self._patched)
        self._patched = install_adapters(self.lightning_module, self._ctx)
        _warn_non_exact_layers(self.lightning_module)
        if trainer.state.fn == TrainerFn.FITTING:
            self._loss_scale = self._compute_loss_scale(partition)
        self._comm_warning.install()
        if self._comm_callback not in trainer.callbacks:
            trainer.callbacks.append(self._comm_callback)
        super().setup(trainer)

    def _compute_loss_scale(self, partition: LocalPartition) -> float:
        if self.loss_weighting == "sum":
            return 1.0
        if self.loss_weighting == "mean":
            return 1.0 / self.world_size
        data = partition.data
        if self.mask_key not in data:
            raise KeyError(
                f"loss_weighting='train_mask' needs a node mask `{self.mask_key}` in the batch; set "
                f"FullGraphStrategy(mask_key=...) or loss_weighting='mean'"
            )
        local = torch.tensor([float(data[self.mask_key].sum())], device=self.root_device)
        total = self.reduce(local.clone(), reduce_op="sum") if self.world_size > 1 else local
        if float(total) == 0:
            raise ValueError(f"no node anywhere is set in `{self.mask_key}`: there is nothing to train on")
        return float(local) / float(total)

    @override
    def configure_ddp(self) -> None:
        # No DDP wrapper (see module docstring); start every rank from rank 0's weights.
        assert self.model is not None
        _sync_module_states(self.model)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self.check_finite and self._loss_scale != 0 and not bool(torch.isfinite(closure_loss).all()):
            # (a rank without training nodes may return the NaN mean of nothing: scaled by 0)
            raise FloatingPointError(
                f"rank {self.global_rank}: the training loss is {float(closure_loss)} at epoch "
                f"{self.lightning_module.current_epoch if self.lightning_module else '?'}; every layer "
                "output was finite, so the loss computation itself produced it"
            )
        scaled = closure_loss * self._loss_scale
        self._step_loss = scaled.detach()
        super().backward(scaled, optimizer, *args, **kwargs)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.world_size > 1:
            self._all_reduce_gradients()

    def _all_reduce_gradients(self) -> None:
        assert self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        if not params:
            return
        # A parameter may have a gradient on some ranks only (e.g. a branch unused here):
        # agree first, so that all ranks all-reduce the same buffers.
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self.root_device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        live = [p for p, h in zip(params, has.tolist()) if h]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in live:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            if self.check_finite and not bool(torch.isfinite(flat).all()):
                raise FloatingPointError(
                    f"rank {self.global_rank}: the summed weight gradient holds NaN/inf although every "
                    "layer output and loss was finite on this rank; another rank's log names the cause"
                )
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().predict_step(*args, **kwargs)
        return self.gather_node_outputs(out)

    def gather_node_outputs(self, out: Any) -> Any:
        """Assembles per-rank node outputs into the global node order.

        Every tensor in ``out`` (nested tuples/lists/dicts too) whose first dimension equals
        the rank's owned node count is gathered from all ranks and returned with one row per
        global node, row ``v`` for global node ``v``.  Other values pass through.
        """
        from lightning_utilities.core.apply_func import apply_to_collection

        assert self._partition is not None
        n_id = self._partition.data.n_id.to(self.root_device)
        n_owned = n_id.numel()
        num_global = self._partition.num_global_nodes

        def gather(t: Tensor) -> Tensor:
            if t.dim() == 0 or t.size(0) != n_owned:
                return t
            if self.world_size == 1:
                result = t.new_empty((num_global,) + tuple(t.shape[1:]))
                result[n_id] = t
                return result
            counts = [
                torch.zeros(1, dtype=torch.long, device=self.root_device) for _ in range(self.world_size)
            ]
            dist.all_gather(counts, torch.tensor([n_owned], device=self.root_device))
            sizes = [int(c) for c in counts]
            width = max(sizes)
            padded = t.new_zeros((width,) + tuple(t.shape[1:]))
            padded[:n_owned] = t
            ids = n_id.new_full((width,), -1)
            ids[:n_owned] = n_id
            rows = [torch.empty_like(padded) for _ in sizes]
            all_ids = [torch.empty_like(ids) for _ in sizes]
            dist.all_gather(rows, padded.contiguous())
            dist.all_gather(all_ids, ids)
            result = t.new_empty((num_global,) + tuple(t.shape[1:]))
            for size, r, i in zip(sizes, rows, all_ids):
                result[i[:size]] = r[:size]
            return result

        return apply_to_collection(out, Tensor, gather)

    @override
    def teardown(self) -> None:
        if self._exchanger is not None and self._exchanger.staleness is not None:
            if self._failed:
                self._exchanger.staleness.abandon()  # a peer may be gone: never wait
            else:
                self._exchanger.staleness.drain()
        uninstall_adapters(self._patched)
        self._patched = []
        if self._exchanger is not None:
            self._exchanger.clear_cache()
        self._comm_warning.remove()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)
        message = str(exception)
        if any(s in message for s in ("Timed out", "timed out", "Connection closed", "Connection reset")):
            exception.args = (
                f"{message}\n\nFullGraphStrategy: another rank stopped taking part in the halo "
                "exchange (it crashed, was killed, or ran a different number of layers/steps). "
                "Check the other ranks' logs; every rank must run the same model, and a loss that "
                "does not depend on the model output on some rank skips its backward exchanges.",
            ) + tuple(exception.args[1:])

    def _maybe_assign_bits(self, epoch: int) -> dict[str, float] | None:
        """Re-assigns bit-widths every ``assign_every`` epochs (adaptive adaqp; collective)."""
        exchanger = self._exchanger
        if (
            self.bits != "adaptive"
            or exchanger is None
            or self._link_costs is None
            or self._send_weights is None
            or epoch == 0
            or epoch % self.assign_every
            or not exchanger.row_range
        ):
            return None
        from lightning_fullgraph.comm.adaptive import assign_layer_bits

        return assign_layer_bits(
            exchanger,
            self._halo_group,
            self._link_costs,
            self._send_weights,
            exchanger.layer_dims,
            lambda_=self.lambda_,
            group_size=self.group_size,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        # Runs before setup, when our callback is not attached yet: restore its state here.
        state = checkpoint.get("callbacks", {}).get(self._comm_callback.state_key)
        if state:
            self._comm_callback.load_state_dict(state)

    def _epoch_adaptive_update(self) -> dict[str, float]:
        """Sylvie's epoch-adaptive rule, on the global loss (identical on every rank)."""
        exchanger = self._exchanger
        if not (self.epoch_adaptive and exchanger is not None and exchanger.staleness is not None):
            return {}
        if self._step_loss is None:
            return {}
        loss = self._step_loss.clone().reshape(1).to(self.root_device, torch.float64)
        if self.world_size > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        value = float(loss)
        previous, self._last_loss = self._last_loss, value
        if previous is not None and exchanger.bits in (1, 2, 4, 8):
            stalled = previous - value < self.adaptive_tolerance * abs(previous)
            exchanger.bits = min(8, exchanger.bits * 2) if stalled else max(1, exchanger.bits // 2)
            exchanger.staleness.force_sync = stalled
        return {"comm/global_loss": value}

    def pipeline_state(self) -> dict[str, Any]:
        """This rank's compression state: rounding RNG, bit-widths, stale buffers."""
        ex = self._exchanger
        if ex is None:
            return {}
        return {
            "rank": self.global_rank,
            "generator": ex.generator.get_state() if ex.generator is not None else None,
            "bits": ex.bits,
            "layer_bits": {k: (a.cpu(), b.cpu()) for k, (a, b) in ex.layer_bits.items()},
            "row_range": {k: v.cpu() for k, v in ex.row_range.items()},
            "layer_dims": dict(ex.layer_dims),
            "staleness": ex.staleness.state_dict() if ex.staleness is not None else None,
            "last_loss": self._last_loss,
            "link_costs": None
            if self._link_costs is None
            else {k: (c.alpha, c.beta) for k, c in self._link_costs.items()},
        }

    def load_pipeline_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`pipeline_state` (now, or at the first step if not set up yet)."""
        ex = self._exchanger
        if ex is None:
            self._pending_state = state
            return
        device = self.root_device
        if state.get("generator") is not None and ex.generator is not None:
            ex.generator.set_state(state["generator"])
        ex.bits = state.get("bits", ex.bits)
        ex.layer_bits = {
            int(k): (a.to(device), b.to(device)) for k, (a, b) in state.get("layer_bits", {}).items()
        }
        ex.row_range = {int(k): v.to(device) for k, v in state.get("row_range", {}).items()}
        ex.layer_dims = {int(k): int(v) for k, v in state.get("layer_dims", {}).items()}
        if state.get("staleness") is not None and ex.staleness is not None:
            ex.staleness.load_state_dict(state["staleness"], device)
        self._last_loss = state.get("last_loss")
        if state.get("link_costs") is not None and self._link_costs is not None:
            from lightning_fullgraph.comm.assign import LinkCost

            # the assignment must see the links the interrupted run measured
            self._link_costs = {tuple(k): LinkCost(*ab) for k, ab in state["link_costs"].items()}
        self._pending_state = None

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


_NON_EXACT_NORMS = ("BatchNorm", "GraphNorm", "InstanceNorm", "PairNorm", "DiffGroupNorm", "GraphSizeNorm")


def _warn_non_exact_layers(module: torch.nn.Module) -> None:
    """Warns about layers whose statistics span nodes of several ranks (not exact here)."""
    from torch_geometric.nn.norm import LayerNorm as PygLayerNorm

    names = set()
    for m in module.modules():
        name = type(m).__name__
        if any(name.startswith(n) or name == n for n in _NON_EXACT_NORMS):
            names.add(name)
        if isinstance(m, PygLayerNorm) and getattr(m, "mode", "graph") == "graph":
            names.add("torch_geometric.nn.LayerNorm(mode='graph')")
    if names:
        rank_zero_warn(
            f"{sorted(names)} normalise over the nodes of a batch; under FullGraphStrategy each rank "
            "only sees its own partition, so their statistics differ from a single-process run. "
            "Use per-node normalisation (torch.nn.LayerNorm, or PyG LayerNorm(mode='node')) for "
            "exact results."
        )


_PROGRESS_BAR = ("comm/bytes_sent", "comm/bits")


class _CommMetricsLogger(Callback):
    """Logs halo-traffic counters of the training step, summed over ranks, every epoch.

    Metrics (visible in ``trainer.callback_metrics`` and the loggers):
    ``comm/bytes_sent``, ``comm/bytes_recv`` (bytes on the wire per epoch, all ranks),
    ``comm/exchanges`` and ``comm/wait_time`` (seconds blocked in collectives, summed).
    """

    def __init__(self, strategy: FullGraphStrategy) -> None:
        self.strategy = strategy
        self._assign: dict[str, float] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        exchanger = self.strategy.exchanger
        if exchanger is None:
            return
        if self.strategy._pending_state is not None:
            self.strategy.load_pipeline_state(self.strategy._pending_state)
        exchanger.stats.reset()
        self._assign = self.strategy._maybe_assign_bits(trainer.current_epoch)
        exchanger.begin_step(compress=True, epoch=trainer.current_epoch)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        exchanger = self.strategy.exchanger
        if exchanger is None:
            return
        exchanger.begin_step(compress=False)
        s = exchanger.stats
        layers = sorted(k for k in s.layer_values if k >= 0)
        # one all-reduce for every figure: sums over ranks
        raw = [s.bytes_sent, s.bytes_recv, s.exchanges, s.wait_time, s.quant_time, s.bits_sent, s.values_sent]
        raw += [s.layer_bits[k] for k in layers] + [s.layer_values[k] for k in layers]
        values = torch.tensor(raw, dtype=torch.float64, device=pl_module.device)
        if self.strategy.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        v = values.tolist()
        figures = {
            "comm/bytes_sent": v[0],
            "comm/bytes_recv": v[1],
            "comm/exchanges": v[2],
            "comm/wait_time": v[3],
            "comm/quant_time": v[4],
            "comm/bits": v[5] / v[6] if v[6] else 0.0,
        }
        n = len(layers)
        for i, k in enumerate(layers):
            figures[f"comm/bits_layer{k}"] = v[7 + i] / v[7 + n + i] if v[7 + n + i] else 0.0
        if self._assign:
            figures["comm/assign_time"] = self._assign["assign_time"]
            figures["comm/assign_solve_time"] = self._assign["solve_time"]
        st = exchanger.staleness
        if st is not None:
            # the schedule is identical on every rank: these are this rank's (= every rank's)
            ages = [a for _, _, a in st.ages]
            figures["comm/staleness_max"] = float(max(ages, default=0))
            figures["comm/staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
            figures["comm/sync_epoch"] = float(exchanger._sync)
        figures.update(self.strategy._epoch_adaptive_update())
        for name, value in figures.items():
            if math.isfinite(value):
                pl_module.log(
                    name,
                    value,
                    on_step=False,
                    on_epoch=True,
                    reduce_fx="sum",
                    batch_size=1,
                    prog_bar=name in _PROGRESS_BAR,
                )

    def state_dict(self) -> dict[str, Any]:
        # Called on every rank when a checkpoint is written (only rank 0's copy is saved), so
        # gather every rank's pipeline state into it.
        state = self.strategy.pipeline_state()
        if self.strategy.world_size > 1 and dist.is_initialized():
            gathered: list[Any] = [None] * self.strategy.world_size
            dist.all_gather_object(gathered, state)
        else:
            gathered = [state]
        return {"ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks", [])
        rank = self.strategy.global_rank
        if rank < len(ranks) and ranks[rank]:
            self.strategy.load_pipeline_state(ranks[rank])

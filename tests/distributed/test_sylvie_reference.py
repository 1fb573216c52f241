r"""Sylvie mode against a single-process simulation of its bounded-staleness schedule.

The simulation builds the very partitions :class:`FullGraphDataModule` builds (same cache
folder, ``load_part`` per rank), then runs all ``P`` ranks in one process with ONE copy of
the model: every message-passing layer is the model's own (unpatched) conv called on each
rank's local bipartite graph.  Messages are fp32 (``bits=32``) and nothing is random, so the
distributed run must reproduce the simulated weights up to summation order (``1e-5``).

The schedule (the specification; ``eps`` = ``staleness``, ``gamma`` = ``smoothing``)
-------------------------------------------------------------------------------------
* Epoch ``t`` is synchronous iff ``t % eps == 0`` (epoch 0 is synchronous).
* Rank ``r``, layer ``l``: the conv runs on the local bipartite graph with input
  ``cat(X_r^l, H_r^l)`` (owned rows, then halo rows grouped by owner) and outputs the owned rows.
* Synchronous epoch: ``H_r^l`` are the fresh halo rows of this epoch's ``X^l`` (as in exact
  mode); in backward the halo-row gradients go home and are added into the owners' gradient
  of ``X^l`` in the same backward.  The received values are kept:
  ``HALO[l, r] :=`` the fresh halo rows, ``GRAD[l, q] :=`` the ``[S_q]`` gradient rows owner
  ``q`` received (one per send row, in send order).
* Asynchronous epoch ``t``: layer ``l`` of rank ``r`` consumes ``HALO[l, r]`` as a constant
  (no autograd into other ranks), received during epoch ``t-1``; in backward owner ``q``'s
  gradient of ``X_q^l`` gets ``GRAD[l, q]`` (received during epoch ``t-1``) added at its send
  rows (``index_add`` at ``send_index``), and this epoch's halo gradients are sent (they are
  ``GRAD`` for epoch ``t+1``); forward likewise sends this epoch's boundary rows (``HALO`` for
  ``t+1``).  EXCEPTION: if epoch ``t+1`` is synchronous, epoch ``t`` sends nothing (neither
  rows nor gradients): the synchronous epoch would throw them away; ``HALO``/``GRAD`` stay.
* Weight gradients: rank ``r``'s loss is its mean over its own training nodes times
  ``n_r / n``; gradients are summed over ranks; one SGD step per epoch.
* Smoothing (PipeGCN, features and gradients): averages ``AVG_H[l, r]``, ``AVG_G[l, q]``.  A
  value received in a synchronous epoch resets the average to it; a value received for an
  asynchronous epoch (sent in ``t-1``, landed for ``t``) updates
  ``avg = gamma * avg + (1 - gamma) * received``.  Asynchronous epochs consume the averages,
  synchronous ones fresh values.  Without smoothing, average = received value.

The layer-0 input is the batch's features: constant, so its halo is the same whether fresh
or stale (or smoothed), and it needs no gradient; the simulation always uses the fresh rows.

Projected messages (``project_messages=True``, the default): a GCN or SAGE layer after the
first whose projection narrows the rows (here the output layer, ``16 -> 3``) sends
``M^l = X^l W`` instead of ``X^l``: everything above holds with ``M`` for ``X`` (``HALO``,
``GRAD``, the averages are ``M``'s rows and gradients; stale gradients are added into
``M_q^l``'s gradient), and the layer aggregates ``cat(M_r^l, H_r^l)`` (GCN: plus the bias;
SAGE: plus ``b_l`` and the root term ``X_r^l W_r^T``).  ``simulate_sylvie(project=False)``
is the input-message schedule.

Implementation (autograd does the bookkeeping): in a synchronous epoch the halo is gathered
from the owners' ``X^l`` WITH autograd (the gradient flows home by itself; ``retain_grad``
captures what was "received"); in an asynchronous epoch it is a detached leaf whose ``.grad``
is what gets "sent", and :class:`_AddGradient` (identity forward, backward adds a given
tensor) injects the stale gradients into ``X_q^l`` before ``X_q^l`` is used.  GCN layers get
PyG's normalisation with GLOBAL degrees (as the strategy's adapter computes them), computed
here from the global graph; SAGE layers are called with ``(x_full, x_owned)`` and ``size``.

Negative controls (simulation only) show the comparison discriminates: the superseded
behaviour (stale gradients dropped after a synchronous epoch) and exact training both give
clearly different weights.  Sending in the epoch before a synchronous one changes no weight
(the synchronous epoch overwrites it); the distributed tests check it through the traffic
counters instead.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.nn import GCNConv, GINConv, GraphConv, SAGEConv
from torch_geometric.utils import add_remaining_self_loops, scatter

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.comm.plan import LocalPartition
from lightning_fullgraph.partition.cache import load_part
from tests.helpers import (
    PIPELINED,
    NodeClassifier,
    cpu_trainer,
    directed_graph,
    reference_training,
    without_training_nodes_on_last_rank,
)

pytestmark = pytest.mark.timeout(180)

WORLD = 3
EPOCHS = 7
LR = 0.5  # SGD; large enough that one epoch of staleness moves the weights by ~1e-3
TOL = dict(rtol=1e-5, atol=1e-5)
# Differences the negative controls must exceed: far above the comparison tolerance.
CLEARLY_DIFFERENT = 1e-3


# -- the simulation ----------------------------------------------------------------------


class _AddGradient(torch.autograd.Function):
    """Identity in forward; backward adds ``extra`` to the incoming gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, extra: Tensor) -> Tensor:
        ctx.extra = extra
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad + ctx.extra, None


def datamodule_partitions(data: Data, world: int, cache_dir: Path) -> list[LocalPartition]:
    """Every rank's LocalPartition, as the datamodule of a ``world``-rank run loads it."""
    dm = FullGraphDataModule(data, num_parts=world, cache_dir=cache_dir)
    dm.prepare_data()
    assert dm.partition_result is not None
    return [load_part(dm.partition_result.folder, r) for r in range(world)]


class _Routes:
    """Who sends which rows to whom (from the plans)."""

    def __init__(self, parts: list[LocalPartition]) -> None:
        self.parts = parts
        world = len(parts)
        # send_rows[q][r]: the rows of q's owned block that r holds as halo, in r's order
        self.send_rows = [list(p.plan.send_index.split(p.plan.send_counts)) for p in parts]
        for q, p in enumerate(parts):
            assert p.plan.rank == q and p.plan.world_size == world
            for r in range(world):
                assert parts[r].plan.recv_counts[q] == p.plan.send_counts[r]

    def halo(self, xs: list[Tensor], r: int) -> Tensor:
        """``[H_r, F]``: rank ``r``'s halo rows, grouped by owner (differentiable in ``xs``)."""
        return torch.cat([xs[q].index_select(0, self.send_rows[q][r]) for q in range(len(xs))])

    def home(self, halo_grads: list[Tensor]) -> list[Tensor]:
        """Halo-row gradients of every rank -> ``[S_q, F]`` rows each owner receives, in its
        send order (peer rank ascending, the peer's halo order inside)."""
        chunks = [g.split(self.parts[r].plan.recv_counts) for r, g in enumerate(halo_grads)]
        return [torch.cat([chunks[r][q] for r in range(len(chunks))]) for q in range(len(chunks))]

    def scatter_home(self, q: int, grad_rows: Tensor, width: int) -> Tensor:
        """``[S_q, F]`` received gradient rows -> ``[N_q, F]`` (index_add at send_index)."""
        plan = self.parts[q].plan
        out = grad_rows.new_zeros(plan.num_owned, width)
        return out.index_add_(0, plan.send_index, grad_rows)


def _gcn_local_edges(data: Data, part: LocalPartition) -> tuple[Tensor, Tensor]:
    """Rank-local GCN edges (self-loops on owned nodes) weighted with GLOBAL degrees."""
    n = data.num_nodes
    ei, w = add_remaining_self_loops(data.edge_index, torch.ones(data.edge_index.size(1)), 1.0, num_nodes=n)
    deg = scatter(w, ei[1], dim=0, dim_size=n, reduce="sum")
    dis = deg.pow(-0.5).masked_fill(deg == 0, 0.0)
    local = part.data.edge_index
    ei_r, w_r = add_remaining_self_loops(local, torch.ones(local.size(1)), 1.0, num_nodes=part.plan.num_owned)
    gid = torch.cat([part.data.n_id, part.data.halo_n_id])
    return ei_r, dis[gid[ei_r[0]]] * w_r * dis[gid[ei_r[1]]]


def _projects(conv: torch.nn.Module, layer: int, width: int) -> bool:
    """Whether the package sends this layer's projected rows: a GCN or SAGE layer whose input
    needs a gradient (every layer after the first) and whose projection narrows the rows."""
    return layer > 0 and isinstance(conv, (GCNConv, SAGEConv)) and conv.out_channels < width


def _projection(conv: torch.nn.Module, x: Tensor) -> Tensor:
    """``X W``: GCN's ``lin``, SAGE's ``lin_l`` without its bias."""
    return conv.lin(x) if isinstance(conv, GCNConv) else F.linear(x, conv.lin_l.weight)


def _run_projected(conv: torch.nn.Module, x: Tensor, m: Tensor, halo: Tensor, part: LocalPartition, gcn_edges) -> Tensor:
    """A projecting layer on rank-local ``[M_r | halo] -> owned``, from PyG's own ``propagate``."""
    m_full = torch.cat([m, halo])
    n = x.size(0)
    if isinstance(conv, GCNConv):
        ei, w = gcn_edges
        return conv.propagate(ei, x=m_full, edge_weight=w)[:n] + conv.bias
    out = conv.propagate(part.data.edge_index, x=(m_full, m), size=(m_full.size(0), n)) + conv.lin_l.bias
    if conv.root_weight:
        out = out + conv.lin_r(x)
    return F.normalize(out, p=2.0, dim=-1) if conv.normalize else out


def _run_conv(conv: torch.nn.Module, x: Tensor, halo: Tensor, part: LocalPartition, gcn_edges) -> Tensor:
    """The conv's own forward on rank-local bipartite graph ``[owned | halo] -> owned``."""
    x_full = torch.cat([x, halo])
    n = x.size(0)
    if isinstance(conv, GCNConv):
        ei, w = gcn_edges
        conv.normalize = False  # normalised above, with global degrees
        try:
            return conv(x_full, ei, w)[:n]
        finally:
            conv.normalize = True
    assert isinstance(conv, (SAGEConv, GraphConv, GINConv)), type(conv)
    return conv((x_full, x), part.data.edge_index, size=(x_full.size(0), n))


def simulate_sylvie(
    model: NodeClassifier,
    data: Data,
    parts: list[LocalPartition],
    epochs: int,
    eps: int,
    smoothing: float | None = None,
    drop_gradients_after_sync: bool = False,
    send_before_sync: bool = False,
    grads_out: list[dict[str, Tensor]] | None = None,
    project: bool = True,
) -> dict[str, Tensor]:
    """Single-process simulation of the schedule in the module docstring; returns weights.
    ``project``: projected messages (the package's default) or every layer's input.

    ``drop_gradients_after_sync`` / ``send_before_sync`` reproduce the superseded behaviour
    (the gradients of a synchronous epoch's halo rows are not kept for the next epoch; the
    epoch before a synchronous one sends anyway) for the negative controls.  ``grads_out``
    (if given) receives every epoch's summed weight gradients.
    """
    model = copy.deepcopy(model)
    model.train()
    opt = model.configure_optimizers()
    routes = _Routes(parts)
    world, layers = len(parts), len(model.convs)
    n_train = [int(p.data.train_mask.sum()) for p in parts]
    total = sum(n_train)
    gcn_edges = [_gcn_local_edges(data, p) for p in parts] if isinstance(model.convs[0], GCNConv) else [None] * world

    def blend(avg: Tensor | None, received: Tensor) -> Tensor:
        if avg is None or smoothing is None:
            return received.clone()
        return smoothing * avg + (1.0 - smoothing) * received

    halo_avg: dict[tuple[int, int], Tensor] = {}
    grad_avg: dict[tuple[int, int], Tensor | None] = {}
    for t in range(epochs):
        sync = t % eps == 0
        sends = sync or send_before_sync or (t + 1) % eps != 0
        opt.zero_grad()
        halos: dict[tuple[int, int], Tensor] = {}  # what rank r's layer l consumed
        sent: dict[tuple[int, int], Tensor] = {}  # async: this epoch's rows, for epoch t+1
        xs = [p.data.x for p in parts]
        for layer, conv in enumerate(model.convs):
            pipelined = layer > 0  # layer 0 reads the constant input features: always fresh
            projected = project and _projects(conv, layer, xs[0].size(1))
            ms = [_projection(conv, x) for x in xs] if projected else xs  # what travels
            if pipelined and not sync:
                ms = [
                    _AddGradient.apply(ms[q], routes.scatter_home(q, g, ms[q].size(1)))
                    if (g := grad_avg.get((layer, q))) is not None
                    else ms[q]
                    for q in range(world)
                ]
                if not projected:
                    xs = ms
            outs = []
            for r in range(world):
                if not pipelined:
                    halo = routes.halo(ms, r)
                elif sync:
                    halo = routes.halo(ms, r)
                    halo.retain_grad()
                    halos[layer, r] = halo
                else:
                    sent[layer, r] = routes.halo([m.detach() for m in ms], r)
                    halo = halo_avg[layer, r].clone().requires_grad_()
                    halos[layer, r] = halo
                if projected:
                    out = _run_projected(conv, xs[r], ms[r], halo, parts[r], gcn_edges[r])
                else:
                    out = _run_conv(conv, ms[r], halo, parts[r], gcn_edges[r])
                if layer < layers - 1:  # as NodeClassifier.forward
                    out = model.norms[layer](out)
                    out = F.relu(out)
                    out = F.dropout(out, p=model.hparams.dropout, training=model.training)
                outs.append(out)
            xs = outs
        loss = xs[0].new_zeros(())
        for r, p in enumerate(parts):
            if n_train[r]:
                mask = p.data.train_mask
                loss = loss + F.cross_entropy(xs[r][mask], p.data.y[mask]) * (n_train[r] / total)
            else:  # no training node: zero loss, but its backward (and exchanges) still run
                loss = loss + (xs[r] * 0.0).sum()
        loss.backward()
        if grads_out is not None:
            grads_out.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()

        # what was received this epoch, for the next one
        for layer in range(1, layers):
            grads = [
                halos[layer, r].grad if halos[layer, r].grad is not None else torch.zeros_like(halos[layer, r])
                for r in range(world)
            ]
            home = routes.home(grads)
            if sync:
                for r in range(world):
                    halo_avg[layer, r] = halos[layer, r].detach().clone()
                for q in range(world):
                    grad_avg[layer, q] = None if drop_gradients_after_sync else home[q].clone()
            elif sends:
                for r in range(world):
                    halo_avg[layer, r] = blend(halo_avg[layer, r], sent[layer, r])
                for q in range(world):
                    grad_avg[layer, q] = blend(grad_avg[layer, q], home[q])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_weights_close(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **TOL, msg=lambda m, k=key: f"{what} {k}: {m}")


# -- the distributed run -----------------------------------------------------------------


class _TrafficProbe(pl.Callback):
    """Runs in every rank; logs the per-epoch halo message bytes (rows and gradients; not the
    cached one-time transfers) sent in async epochs followed by a synchronous one (must be 0)
    and in the other async epochs (must be > 0, or the probe proves nothing).  The trainer
    returns rank 0's figures to the test process."""

    def __init__(self, eps: int) -> None:
        self.eps = eps
        self.before_sync = 0.0
        self.other_async = 0.0

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        epoch = trainer.current_epoch
        sent = trainer.strategy.exchanger.stats.bytes_sent
        if isinstance(sent, dict):  # bytes per kind of transfer: the per-epoch messages only
            sent = sent["message"]
        sent = float(sent)
        if epoch % self.eps != 0:
            if (epoch + 1) % self.eps == 0:
                self.before_sync += sent
            else:
                self.other_async += sent
        for name, value in (("before_sync", self.before_sync), ("other_async", self.other_async)):
            pl_module.log(f"probe/{name}", value, on_step=False, on_epoch=True, batch_size=1)


def _distributed(model: NodeClassifier, data: Data, cache_dir: Path, eps: int, smoothing: float | None,
                 project: bool = True):
    probe = _TrafficProbe(eps)
    trainer = cpu_trainer(WORLD, max_epochs=EPOCHS, callbacks=[probe], strategy_kwargs={
        "mode": "sylvie", **PIPELINED, "bits": 32, "staleness": eps, "smoothing": smoothing,
        "project_messages": project})
    trainer.fit(model, datamodule=FullGraphDataModule(data, cache_dir=cache_dir))
    return model.state_dict(), trainer.callback_metrics


def _check_traffic(metrics, eps: int) -> None:
    if EPOCHS > 2 and eps > 2:
        assert float(metrics["probe/other_async"]) > 0, "no traffic seen in async epochs: the probe is broken"
    if any(t % eps and (t + 1) % eps == 0 for t in range(EPOCHS)):
        assert float(metrics["probe/before_sync"]) == 0, (
            "async epochs followed by a synchronous epoch sent halo rows/gradients "
            f"({float(metrics['probe/before_sync'])} bytes on rank 0); the synchronous epoch throws them away"
        )


@pytest.mark.parametrize(
    ("conv", "eps", "smoothing"),
    [("sage", 3, None), ("sage", 3, 0.5), ("sage", 2, None), ("gcn", 4, 0.5)],
)
def test_distributed_sylvie_matches_reference_schedule(conv: str, eps: int, smoothing, tmp_path) -> None:
    data = directed_graph(seed=31)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3, lr=LR)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    expected = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing)
    actual, metrics = _distributed(model, data, tmp_path, eps, smoothing)
    _assert_weights_close(actual, expected, f"{conv} eps={eps} gamma={smoothing}")
    _check_traffic(metrics, eps)


@pytest.mark.parametrize(("conv", "eps", "smoothing"), [("sage", 3, 0.5), ("gcn", 4, None)])
def test_input_messages_match_the_input_message_schedule(conv: str, eps: int, smoothing, tmp_path) -> None:
    """``project_messages=False``: every layer sends its input, and the run follows the
    simulation of that schedule, which differs from the projected one by far more than the
    tolerance (so the comparison tells the two messages apart).

    Negative control (run): simulating projected messages here fails the comparison."""
    data = directed_graph(seed=31)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3, lr=LR)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    expected = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing, project=False)
    assert _max_diff(expected, simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing)) > CLEARLY_DIFFERENT
    actual, metrics = _distributed(model, data, tmp_path, eps, smoothing, project=False)
    _assert_weights_close(actual, expected, f"inputs {conv} eps={eps} gamma={smoothing}")
    _check_traffic(metrics, eps)


def test_rank_without_training_nodes_matches_reference_schedule(tmp_path) -> None:
    """That rank contributes no loss but still exchanges rows and (stale) gradients."""
    data = without_training_nodes_on_last_rank(directed_graph(seed=32), WORLD)
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, lr=LR)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    assert int(parts[-1].data.train_mask.sum()) == 0 and parts[-1].plan.num_send > 0
    expected = simulate_sylvie(model, data, parts, EPOCHS, 4, 0.5)
    assert _max_diff(expected, simulate_sylvie(model, data, parts, EPOCHS, 1)) > CLEARLY_DIFFERENT
    actual, metrics = _distributed(model, data, tmp_path, 4, 0.5)
    _assert_weights_close(actual, expected, "no training nodes on the last rank")
    _check_traffic(metrics, 4)


# -- the simulation checked on its own (no process group) --------------------------------


@pytest.mark.parametrize("conv", ["sage", "gcn"])
def test_simulation_with_eps_one_is_exact_training(conv: str, tmp_path) -> None:
    data = directed_graph(seed=31)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3, lr=LR)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    expected = reference_training(copy.deepcopy(model), data, EPOCHS)
    assert _max_diff(expected, model.state_dict()) > CLEARLY_DIFFERENT  # training moves the weights
    for smoothing in (None, 0.5):
        _assert_weights_close(simulate_sylvie(model, data, parts, EPOCHS, 1, smoothing), expected, f"{conv} eps=1")


@pytest.mark.parametrize(("conv", "eps", "smoothing"), [("sage", 3, None), ("sage", 3, 0.5), ("gcn", 4, 0.5)])
def test_simulation_discriminates(conv: str, eps: int, smoothing, tmp_path) -> None:
    """The schedule differs from exact training and from the superseded behaviour."""
    data = directed_graph(seed=31)
    torch.manual_seed(0)
    model = NodeClassifier(conv=conv, num_layers=3, lr=LR)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    new = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing)
    exact = reference_training(copy.deepcopy(model), data, EPOCHS)
    assert _max_diff(new, exact) > CLEARLY_DIFFERENT, "async epochs do not differ from exact training"
    old = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing, drop_gradients_after_sync=True,
                          send_before_sync=True)
    assert _max_diff(new, old) > CLEARLY_DIFFERENT, "dropping the sync epoch's gradients changes nothing"
    if smoothing is not None:
        plain = simulate_sylvie(model, data, parts, EPOCHS, eps, None)
        assert _max_diff(new, plain) > CLEARLY_DIFFERENT, "smoothing changes nothing"
    dropped = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing, drop_gradients_after_sync=True)
    assert _max_diff(new, dropped) > CLEARLY_DIFFERENT
    # Sends before a synchronous epoch are overwritten by it: no weight can show them
    # (the distributed tests look at the traffic instead).
    wasted = simulate_sylvie(model, data, parts, EPOCHS, eps, smoothing, send_before_sync=True)
    _assert_weights_close(wasted, new, "send_before_sync")


def test_with_frozen_weights_every_epoch_has_the_exact_gradient(tmp_path) -> None:
    """lr=0: stale rows and gradients equal fresh ones, so every epoch's weight gradient is
    the exact one -- the async path (stale halo, injected gradients, routing) is right; the
    superseded behaviour misses the owners' share in the first async epoch after a sync."""
    data = directed_graph(seed=31)
    torch.manual_seed(0)
    model = NodeClassifier(conv="sage", num_layers=3, lr=0.0)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    ref = copy.deepcopy(model)
    ref.training_step(data, 0).backward()
    exact = {k: p.grad for k, p in ref.named_parameters()}
    grads: list[dict[str, Tensor]] = []
    simulate_sylvie(model, data, parts, EPOCHS, 3, 0.5, grads_out=grads)
    for epoch, g in enumerate(grads):
        _assert_weights_close(g, exact, f"epoch {epoch} gradient")
    old: list[dict[str, Tensor]] = []
    simulate_sylvie(model, data, parts, 2, 3, 0.5, drop_gradients_after_sync=True, grads_out=old)
    assert _max_diff(old[1], exact) > CLEARLY_DIFFERENT


def test_gradient_routing_is_the_adjoint_of_the_halo_gather(tmp_path) -> None:
    """<gather(X), G> == <X, home(G)>: the simulated exchange's two directions agree."""
    data = directed_graph(seed=31)
    parts = datamodule_partitions(data, WORLD, tmp_path)
    routes = _Routes(parts)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(p.plan.num_owned, 5, generator=gen) for p in parts]
    gs = [torch.randn(p.plan.num_halo, 5, generator=gen) for p in parts]
    assert all(g.size(0) > 0 for g in gs)
    lhs = sum(float((routes.halo(xs, r) * gs[r]).sum()) for r in range(WORLD))
    home = routes.home(gs)
    rhs = sum(float((xs[q] * routes.scatter_home(q, home[q], 5)).sum()) for q in range(WORLD))
    assert lhs == pytest.approx(rhs, rel=1e-5)

r"""Where the stale pipeline's error comes from: a single-process simulation, one cause at a time.

Independent of the package's exchange code: the whole graph lives in one process, split by
the METIS parts into the aggregation over same-part edges :math:`\hat A_{in}` and over
cross-part edges :math:`\hat A_{x}` (GCN normalisation with global degrees, self-loops in
:math:`\hat A_{in}`).  Layer :math:`l > 0` aggregates

.. math::
    Z^{(l)}_t = \hat A_{in} X^{(l)}_t + \hat A_{x} \tilde X^{(l)}, \qquad
    \nabla X^{(l)}_t \mathrel{+}= \tilde G^{(l)}

where the variants choose the cross-part rows :math:`\tilde X` and the cross-part gradient
:math:`\tilde G` (the gradient the borrowed rows' consumers send home):

* ``exact``: :math:`\tilde X = X_t`, gradient through it (one process, the reference);
* ``stale`` (PipeGCN / Sylvie-A): :math:`\tilde X = X_{t-1}` (detached),
  :math:`\tilde G = \hat A_x^\top \partial L_{t-1} / \partial Z_{t-1}` of the previous epoch;
* ``rows``: stale rows, fresh gradient (the cross-part gradient of epoch t flows to
  :math:`X_t`);
* ``grads``: fresh rows, stale gradient.

``--eps k`` makes every k-th epoch synchronous (its rows and gradient are kept for the next
epochs, as :mod:`lightning_fullgraph.comm.policies.sylvie.pipeline` does); ``--warm k`` runs the first k epochs
synchronous; ``--extrapolate`` replaces :math:`\tilde X, \tilde G` by the linear extrapolation
:math:`2 v_{t-1} - v_{t-2}`; ``--guard tau`` applies the divergence guard's rule.

``--bits b`` sends the synchronous epochs' cross-part rows and gradients through the
package's codec (:func:`~lightning_fullgraph.comm.quantize.quantize`, unbiased stochastic
rounding per row); ``--error-feedback both`` adds each message's rounding error to the next one
of the same layer and direction, :math:`\tilde X_t = Q(X_t + e_{t-1})`, :math:`e_t = X_t +
e_{t-1} - \tilde X_t` (:class:`ErrorFeedbackCodec`), ``--error-feedback backward`` does so for
the gradients only: the compressed-communication correction issue 28 asks to measure.
``--ef-study`` prints the codec's contraction ratio per bit-width (:func:`contraction`), then
runs exact, one bit, and one bit with each kind of error feedback over ``--seeds`` and prints
the means (``benchmarks/results/error-feedback.md``).

``python benchmarks/staleness_isolation.py --all`` runs every variant on the low-locality graph
of ``tests/integration/test_convergence.py`` (12,000 nodes, 16 classes, halo share 0.55 at 4
parts; GCN 3 x 256, Adam 0.01, dropout 0.5, 60 epochs, two runs at a time) and prints one
table: best and final validation accuracy per variant.  About 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

VARIANTS: dict[str, list[str]] = {
    "exact": ["--mode", "exact"],
    "stale rows + stale gradients (PipeGCN)": ["--mode", "stale"],
    "stale rows, fresh gradients": ["--mode", "rows"],
    "fresh rows, stale gradients": ["--mode", "grads"],
    "stale, lr 0.003": ["--mode", "stale", "--lr", "0.003"],
    "stale, dropout 0": ["--mode", "stale", "--dropout", "0"],
    "stale, synchronous every 5th epoch": ["--mode", "stale", "--eps", "5"],
    "stale, synchronous every 2nd epoch": ["--mode", "stale", "--eps", "2"],
    "stale, linear extrapolation": ["--mode", "stale", "--extrapolate"],
    "stale after 20 synchronous epochs": ["--mode", "stale", "--warm", "20"],
    "stale every 5th synchronous + guard 0.1": ["--mode", "stale", "--eps", "5", "--guard", "0.1"],
}
EF_VARIANTS: dict[str, list[str]] = {
    "exact (fp32)": ["--mode", "exact"],
    "synchronous, 1 bit": ["--mode", "exact", "--bits", "1"],
    "synchronous, 1 bit + error feedback on rows and gradients": ["--mode", "exact", "--bits", "1",
                                                                   "--error-feedback", "both"],
    "synchronous, 1 bit + error feedback on gradients": ["--mode", "exact", "--bits", "1",
                                                          "--error-feedback", "backward"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all", action="store_true", help="every variant, one table")
    p.add_argument("--mode", choices=("exact", "stale", "rows", "grads"), default="exact")
    p.add_argument("--eps", type=int, default=0, help="every eps-th epoch synchronous (0: only epoch 0)")
    p.add_argument("--warm", type=int, default=0)
    p.add_argument("--extrapolate", action="store_true")
    p.add_argument("--guard", type=float)
    p.add_argument("--cooldown", type=int, default=10)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=0, help="quantize synchronous cross-part messages (0: fp32)")
    p.add_argument("--error-feedback", choices=["off", "both", "backward"], default="off", nargs="?", const="both",
                   help="add the previous epoch's rounding error to the next message: rows and gradients, or "
                        "the gradients only")
    p.add_argument("--ef-study", action="store_true", help="exact, 1 bit, 1 bit + error feedback over --seeds")
    p.add_argument("--seeds", default="0,1,2")
    return p.parse_args(argv)


class ErrorFeedbackCodec:
    r"""The package's codec (unbiased stochastic rounding per row), optionally with error feedback.

    With ``feedback`` each message carries the previous message's rounding error,
    :math:`\tilde v_t = Q(v_t + e_{t-1})`, :math:`e_t = v_t + e_{t-1} - \tilde v_t`, so the sum of
    what was sent telescopes to :math:`\sum_t v_t - e_T`.  That bounds the accumulated error only if
    :math:`Q` is a contraction, :math:`E\|Q(v) - v\|^2 \le (1 - \delta) \|v\|^2`
    (:func:`contraction`).

    Shapes:
        **input:** :math:`(N, F)` fp32, the same shape at every call;
        **output:** :math:`(N, F)` fp32, the dequantized message.
    """

    def __init__(self, bits: int, generator, feedback: bool) -> None:
        self.bits, self.generator, self.feedback = bits, generator, feedback
        self.error = None

    def __call__(self, v):
        from lightning_fullgraph.comm.quantize import dequantize, quantize

        if self.feedback and self.error is not None:
            v = v + self.error
        sent = dequantize(quantize(v.contiguous(), self.bits, self.generator))
        if self.feedback:
            self.error = v - sent
        return sent


def contraction(bits: int, rows: int = 2000, cols: int = 256, steps: int = 20, seed: int = 0) -> tuple[float, float]:
    """``E||Q(v) - v||^2 / ||v||^2`` of the codec on Gaussian rows, and ``||e_steps|| / ||v||`` after
    ``steps`` messages of the same rows with error feedback (grows without bound where the first is > 1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, cols, generator=generator)
    plain = ErrorFeedbackCodec(bits, generator, feedback=False)
    ratio = float((plain(v) - v).pow(2).sum() / v.pow(2).sum())
    fed = ErrorFeedbackCodec(bits, generator, feedback=True)
    for _ in range(steps):
        fed(v)
    return ratio, float(fed.error.norm() / v.norm())


def simulate(a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from common import lowloc_graph
    from torch_geometric.utils import add_remaining_self_loops, scatter

    from lightning_fullgraph.partition.partitioner import partition_graph

    torch.set_num_threads(1)
    g = lowloc_graph()
    n = g.num_nodes
    parts = partition_graph(g.edge_index, n, a.parts)
    ei, _ = add_remaining_self_loops(g.edge_index, num_nodes=n)
    src, dst = ei
    deg = scatter(torch.ones(src.numel()), dst, dim=0, dim_size=n, reduce="sum")
    w = deg[src].rsqrt() * deg[dst].rsqrt()
    cross = parts[src] != parts[dst]

    def adjacency(m):
        return torch.sparse_coo_tensor(torch.stack([dst[m], src[m]]), w[m], (n, n)).coalesce().to_sparse_csr()

    full, inner, outer = adjacency(torch.ones_like(cross)), adjacency(~cross), adjacency(cross)
    torch.manual_seed(a.seed)
    dims = [g.x.size(1), a.hidden, a.hidden, 16]
    lins = [torch.nn.Linear(dims[i], dims[i + 1]) for i in range(3)]
    for lin in lins:
        torch.nn.init.xavier_uniform_(lin.weight)
        torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.Adam([q for lin in lins for q in lin.parameters()], lr=a.lr, weight_decay=5e-4)
    # per layer: the last two kept rows / gradients (newest first)
    rows: list[list] = [[] for _ in lins]
    grads: list[list] = [[] for _ in lins]

    codec_rng = torch.Generator().manual_seed(10_000 + a.seed)
    # per layer and direction: the codec, with the rounding error of its last message (error feedback)
    codecs = {(layer, direction): ErrorFeedbackCodec(
        a.bits, codec_rng, feedback=a.error_feedback == "both" or (a.error_feedback == direction == "backward"))
        for layer in range(len(lins)) for direction in ("forward", "backward")}

    def send(v: torch.Tensor, layer: int, direction: str) -> torch.Tensor:
        return codecs[(layer, direction)](v.detach())

    class Quantized(torch.autograd.Function):
        """The cross-part rows through the codec forward, their gradient backward."""

        @staticmethod
        def forward(ctx, x, layer):
            ctx.layer = layer
            return send(x, layer, "forward")

        @staticmethod
        def backward(ctx, grad):
            return send(grad, ctx.layer, "backward"), None

    def keep(buf: list, value) -> None:
        buf.insert(0, value)
        del buf[2:]

    def kept(buf: list):
        if a.extrapolate and len(buf) == 2:
            return 2 * buf[0] - buf[1]
        return buf[0]

    class AddGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, extra):
            ctx.extra = extra
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad + ctx.extra, None

    class Capture(torch.autograd.Function):
        """Identity; keeps the gradient that reaches the cross-part rows (a synchronous epoch's
        received gradient)."""

        @staticmethod
        def forward(ctx, x, layer):
            ctx.layer = layer
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            keep(grads[ctx.layer], grad.clone())
            return grad, None

    guard = {"until": -1, "best": math.inf, "first": None, "cooldown": a.cooldown, "reactions": []}

    def forward(train: bool, epoch: int):
        sync = (not train or a.mode == "exact" or epoch < a.warm or epoch <= guard["until"]
                or (epoch % a.eps == 0 if a.eps else epoch == 0))
        x, leaves = g.x, []
        for i, lin in enumerate(lins):
            if i == 0 or not train:
                agg = full @ x
            elif sync or not rows[i]:
                crossing = Capture.apply(x, i)
                if a.bits:
                    crossing = Quantized.apply(crossing, i)
                agg = inner @ x + outer @ crossing
                keep(rows[i], x.detach().clone())
            else:
                old = kept(rows[i]).detach().clone().requires_grad_(a.mode in ("stale", "grads"))
                if a.mode == "grads":  # fresh values, the gradient of the cross edges replaced
                    old = x.detach().clone().requires_grad_(True)
                if a.mode in ("stale", "grads") and grads[i]:
                    x_in = AddGrad.apply(x, kept(grads[i]))
                else:
                    x_in = x
                if a.mode == "rows":  # stale values, the cross edges' gradient flows to x now
                    agg = inner @ x + outer @ (old + (x - x.detach()))
                else:
                    agg = inner @ x_in + outer @ old
                    leaves.append((i, old))
                keep(rows[i], x.detach().clone())
            x = lin(agg)
            if i < len(lins) - 1:
                x = F.dropout(F.relu(x), p=a.dropout, training=train)
        return x, leaves

    curve, losses = [], []
    diverged = None
    for epoch in range(a.epochs):
        opt.zero_grad()
        out, leaves = forward(True, epoch)
        loss = F.cross_entropy(out[g.train_mask], g.y[g.train_mask])
        loss.backward()
        for i, leaf in leaves:
            keep(grads[i], leaf.grad.clone())
        opt.step()
        value = float(loss)
        losses.append(value)
        if not math.isfinite(value) or value > 1e6:
            # diverged: the codec cannot range a non-finite row; report the epoch instead of a traceback
            diverged = epoch
            break
        if a.guard is not None:
            guard["first"] = value if guard["first"] is None else guard["first"]
            if (value - guard["best"] > a.guard * max(guard["best"], guard["first"] / 2)
                    and epoch >= guard["until"] and a.mode != "exact"):
                guard["until"] = epoch + guard["cooldown"]
                guard["cooldown"] *= 2
                guard["reactions"].append(epoch)
            guard["best"] = min(guard["best"], value)
        with torch.no_grad():
            pred = forward(False, epoch)[0].argmax(1)
        curve.append(float((pred[g.val_mask] == g.y[g.val_mask]).float().mean()))
    share = float(cross.sum()) / float(cross.numel())
    return {"halo_share": share, "best": max(curve), "best_epoch": curve.index(max(curve)), "final": curve[-1],
            "curve": curve, "losses": losses, "guard_reactions": guard["reactions"], "diverged": diverged}


def run_all(epochs: int) -> int:
    def one(item):
        name, extra = item
        t = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, *extra, "--epochs", str(epochs)], capture_output=True,
                             text=True, check=True)
        return name, json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, VARIANTS.items()))
    share = results[0][1]["halo_share"]
    print(f"low-locality graph, 4 METIS parts, cross-part share of the aggregation inputs {share:.3f}; "
          f"GCN 3 x 256, Adam 0.01, dropout 0.5, {epochs} epochs, seed 0\n")
    print("| variant | best val acc (epoch) | final | guard reactions |\n|---|---|---|---|")
    for name, r, _ in results:
        print(f"| {name} | {r['best']:.4f} ({r['best_epoch']}) | {r['final']:.4f} | {r['guard_reactions'] or ''} |")
    return 0


def run_ef_study(epochs: int, seeds: list[int]) -> int:
    jobs = [(name, extra, seed) for name, extra in EF_VARIANTS.items() for seed in seeds]

    def one(job):
        name, extra, seed = job
        out = subprocess.run([sys.executable, __file__, *extra, "--epochs", str(epochs), "--seed", str(seed)],
                             capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"{name}, seed {seed} failed:\n{out.stderr[-2000:]}")
        return name, seed, json.loads(out.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(one, jobs))
    share = results[0][2]["halo_share"]
    print(f"low-locality graph, 4 METIS parts, cross-part share {share:.3f}; GCN 3 x 256, Adam 0.01, dropout 0.5, "
          f"{epochs} epochs, seeds {seeds}\n")
    print("| codec bits | E‖Q(v) - v‖² / ‖v‖² | ‖e‖ / ‖v‖ after 20 messages with error feedback |\n|---|---|---|")
    for bits in (1, 2, 4, 8):
        ratio, grown = contraction(bits)
        print(f"| {bits} | {ratio:.3f} | {grown:.3g} |")
    print()
    print("| variant | best val acc, per seed | mean best | mean of the last 5 epochs | diverged (loss > 1e6) "
          "at epoch |\n|---|---|---|---|---|")
    for name in EF_VARIANTS:
        rs = [r for n, _, r in results if n == name]
        bests = [r["best"] for r in rs]
        finals = [sum(r["curve"][-5:]) / len(r["curve"][-5:]) for r in rs]
        diverged = " / ".join("-" if r["diverged"] is None else str(r["diverged"]) for r in rs)
        print(f"| {name} | {' / '.join(f'{b:.4f}' for b in bests)} | {sum(bests) / len(bests):.4f} | "
              f"{sum(finals) / len(finals):.4f} | {diverged} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.all:
        return run_all(a.epochs)
    if a.ef_study:
        return run_ef_study(a.epochs, [int(s) for s in a.seeds.split(",") if s])
    print(json.dumps(simulate(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

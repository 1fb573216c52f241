r"""Make unmodified PyG convs partition-aware, exactly.

A rank holds the rows of the nodes it owns (``x``: ``[N_r, F]``) and a local ``edge_index``
whose sources index ``[owned | halo]`` (``N_r + H_r`` ids) and whose destinations are owned.
Every supported conv is patched (an instance attribute ``forward``, removed again on
teardown) so that the user's call ``conv(x, edge_index, ...)`` becomes

.. math::
    \mathbf{X}^{full}_r = \mathbf{X}_r \,\Vert\, \mathrm{halo}(\mathbf{X}), \qquad
    \mathbf{X}'_r = \mathrm{conv}\big((\mathbf{X}^{full}_r, \mathbf{X}_r),\ \mathcal{E}_r\big)

with the conv's own code doing the maths, on a bipartite graph (sources ``N_r + H_r``,
destinations ``N_r``).  Because ``E_r`` contains *every* in-edge of every owned node, any
conv whose output at node :math:`i` depends only on :math:`x_i`, its in-neighbours'
features and in-edge attributes is exact.  Three families:

* ``bipartite`` (``SAGEConv``, ``GINConv``, ``GINEConv``, ``GraphConv``): called with the tuple
  ``(x_full, x)`` and ``size=(N_r + H_r, N_r)``.
* ``full_then_slice`` (``GATConv``, ``GATv2Conv``): called on ``x_full`` as a homogeneous graph;
  their self-loops for halo rows only reach halo outputs, which are dropped, so the owned
  rows are exact and no projection runs twice.
* ``GCNConv``: normalised with *global* degrees,
  :math:`\hat{A}_{ij} = w_{ji} / \sqrt{\hat d_i \hat d_j}` with
  :math:`\hat d_i = \sum_{j \to i} w_{ji}` after PyG's self-loop rule.  The local graph
  knows the in-degree of every owned node (all its in-edges are local) but not of a halo
  node, so each rank computes its owned degrees and receives the halo degrees through the
  same exchange (once, then cached).

Aggregation.  GCN, SAGE, GIN and GraphConv layers do not aggregate over the edge list the
user passes (an ``[E_r, F]`` message tensor per layer and direction): the adapter hands the
conv's own ``forward`` a cached CSR matrix ``A^T_r`` (``[N_r, N_r + H_r]``, GCN's global
normalisation or the edge weights as values, see :mod:`lightning_fullgraph.nn.sparse`), so PyG
takes its fused ``message_and_aggregate`` path; sum and mean products run with a transpose
built once for the backward.  Max/min aggregation uses ``torch.sparse.mm(..., reduce)`` (CPU
only; on CUDA those layers keep the edge list), GAT/GATv2/GINE always keep the edge list, as do
weights that need a gradient.  With overlap on, the central and marginal rows are two cached
blocks of the same kind; SAGE, GIN and GraphConv aggregate both blocks and then run their own
``forward`` once over all owned rows on the merged aggregation
(:meth:`HaloContext.hand_over`), so their root term reads the layer input itself.
``HaloContext(sparse=False)`` (``FullGraphStrategy(sparse_aggregation=False)``) keeps PyG's
edge path everywhere.

Convs of any other ``MessagePassing`` type raise :class:`UnsupportedConvError` at setup,
naming the type; :func:`register_conv_adapter` adds one and returns a
:class:`torch.utils.hooks.RemovableHandle` that takes it away again.  It checks what it can
at registration: ``"bipartite"`` needs a ``forward`` that takes an ``(x_src, x_dst)`` tuple as
``x`` and a ``size=`` argument, and multi-hop convs (``ChebConv``, ``TAGConv``, ``SGConv``,
``SSGConv``, ``APPNP``, ``ARMAConv``, ``GatedGraphConv``, ``MixHopConv``: one halo exchange per
layer only makes their first hop exact) are refused for both kinds; a callable adapter is the
user's own and is not checked.  :func:`install_adapters`
returns an :class:`AdapterHandle` whose ``remove()`` restores every patched conv exactly.

Aggregation scores.  Every message-passing exchange passes ``score=``: a zero-argument callable
returning, for each halo row :math:`j`, :math:`a_j = \sum_{j \to i} |c_{ij}|` over the local
edges, where :math:`c_{ij}` is the factor with which :math:`x_j` enters node :math:`i`'s
aggregation in that conv (the weight of a halo row in AdaQP's variance model; see
:meth:`HaloContext.score`).  It costs nothing unless called and is cached per conv
configuration and graph when it is.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.conv import (
    APPNP,
    ARMAConv,
    ChebConv,
    GATConv,
    GatedGraphConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GINEConv,
    GraphConv,
    MixHopConv,
    SAGEConv,
    SGConv,
    SSGConv,
    TAGConv,
)
from torch_geometric.utils import add_remaining_self_loops, scatter

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.data.validation import all_finite
from lightning_fullgraph.nn.sparse import (
    DerivedCache,
    SplitBlocks,
    _csr,
    csr_adjacency,
    csr_transpose,
    mean_operator,
    split_blocks,
    spmm,
)

__all__ = [
    "AdapterHandle",
    "HaloContext",
    "UnsupportedConvError",
    "install_adapters",
    "register_conv_adapter",
    "supported_convs",
    "uninstall_adapters",
]

ConvAdapter = Callable[[MessagePassing, Callable[..., Any], "HaloContext", Tensor, Any, tuple, dict], Any]


class UnsupportedConvError(TypeError):
    """A message-passing layer the strategy cannot make exact across partitions."""


class HaloContext:
    """State shared by the patched convs of one module: the exchanger and derived-graph caches.

    Args:
        exchanger: Moves halo rows for this rank.
        overlap: Aggregate central rows while the halo exchange is in flight.
        check_finite: Raise on a non-finite conv output, naming the layer.
        sparse: Aggregate through cached CSR adjacencies (PyG's fused ``message_and_aggregate``
            path) wherever the conv supports it; ``False`` keeps PyG's edge-list path
            (gather ``[E_r, F]`` messages, scatter) everywhere.
    """

    def __init__(
        self, exchanger: HaloExchanger, overlap: bool = False, check_finite: bool = False, sparse: bool = True
    ) -> None:
        self.exchanger = exchanger
        self.overlap = overlap
        self.check_finite = check_finite
        self.sparse = sparse
        self.cache = DerivedCache()
        # (stand-in CSR, aggregation) between `hand_over` and the conv's message_and_aggregate
        self._handoff: tuple[Tensor, Tensor] | None = None
        self._stand_in: tuple[tuple, Tensor] | None = None  # (shape, dtype, device), CSR

    @property
    def num_owned(self) -> int:
        return self.exchanger.plan.num_owned

    @property
    def num_full(self) -> int:
        return self.exchanger.plan.num_owned + self.exchanger.plan.num_halo

    def check_input(self, conv: nn.Module, x: Any, edge_index: Any) -> None:
        if isinstance(x, (tuple, list)):
            raise ValueError(
                f"{type(conv).__name__} was called with a (source, target) tuple; under "
                f"FullGraphStrategy call it with the rank's node features `batch.x`-like tensor "
                f"of {self.num_owned} rows, the halo is added for you"
            )
        if not isinstance(x, Tensor) or x.size(0) != self.num_owned:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(conv).__name__} expects the {self.num_owned} rows this rank owns "
                f"(the batch's node features or a layer output computed from them), got {got}"
            )
        if not isinstance(edge_index, Tensor) or edge_index.is_sparse or edge_index.layout != torch.strided:
            raise ValueError(
                f"{type(conv).__name__}: only `edge_index` tensors are supported under "
                f"FullGraphStrategy (got {type(edge_index).__name__}); pass `batch.edge_index` "
                f"(the strategy builds and caches the sparse adjacency itself)"
            )

    def exchange(self, x: Tensor, score: Callable[[], Tensor] | None = None) -> Tensor:
        """``[N_r, F] -> [N_r + H_r, F]``: owned rows followed by the halo rows.

        ``score``: the halo rows' aggregation scores (:meth:`score`), for the exchanger."""
        return self.exchanger.exchange(x, score=score)

    def halo(self, x: Tensor, score: Callable[[], Tensor] | None = None) -> Tensor:
        """``[N_r, F] -> [H_r, F]``: the halo rows alone, what :meth:`exchange` appends."""
        return self.exchanger.halo(x, score=score)

    def exchange_async(self, x: Tensor, score: Callable[[], Tensor] | None = None) -> Any:
        """Starts the exchange of ``x``'s halo rows; ``.wait()`` gives them (``[H_r, F]``)."""
        return self.exchanger.exchange_async(x, score=score)

    def score(
        self,
        conv: MessagePassing,
        edge_index: Tensor,
        weight: Tensor | None = None,
        rule: tuple | None = None,
        sources: tuple[Tensor | None, ...] | None = None,
    ) -> Callable[[], Tensor]:
        r"""The halo rows' aggregation scores of ``conv`` on this rank, as a lazy callable.

        The callable returns ``[H_r]`` float32 (on ``edge_index``'s device):
        :math:`a_j = \sum_{e = (j \to i)} |c_e|` over the local edges ``e`` from halo row
        ``j`` (all destinations are owned), where :math:`c_e` is the factor with which
        :math:`x_j` enters :math:`i`'s aggregation:

        * ``("sum",)``: ``|w_e|`` (1 without weights): GIN, GINE (``relu(x_j + e)``, slope at
          most 1), SAGE / GraphConv ``aggr="add"``, GCN without normalisation.
        * ``("mean",)``: ``|w_e| / in_deg(i)`` (in-edges counted with multiplicity, as PyG's
          mean): SAGE / GraphConv ``aggr="mean"``; also the fallback for any aggregation
          without a fixed coefficient (learned, multi-, std, ...).
        * ``("max",)``: ``|w_e|`` (1 without weights): max/min aggregation (the factor of the
          row that wins; no average is taken).
        * ``("softmax", add_self_loops)``: ``1 / |group(i)|``, the mean of attention weights
          that sum to 1 over ``i``'s softmax group: its in-edges, with PyG's self-loop rule
          (existing self-loops replaced by one) when the conv adds self-loops (GAT, GATv2).
        * GCN passes its normalised edge list (``weight`` = the global-degree values the adapter
          puts in its CSR / ``gcn_norm`` cache) with ``("sum",)``.

        Args:
            conv: The conv (names the rule when ``rule`` is ``None``).
            edge_index: ``[2, E]`` local edges the coefficients refer to.
            weight: ``[E]`` scalar edge weights the conv multiplies messages by, or ``None``.
            rule: One of the rules above; default :func:`_score_rule` of ``conv``.
            sources: The tensors the result is cached on (default ``(edge_index, weight)``).

        Calling it is the only cost: the result is cached per (rule, sources), so every later
        call with the same graph returns the same tensor.
        """
        rule = _score_rule(conv) if rule is None else rule
        key = (edge_index, weight) if sources is None else sources
        num_owned, num_halo = self.num_owned, self.exchanger.plan.num_halo

        def score() -> Tensor:
            return self.cache.get(
                key, ("score", rule), lambda: halo_scores(edge_index, weight, rule, num_owned, num_halo)
            )

        return score

    def use_sparse(self, conv: MessagePassing, x: Tensor, weight: Tensor | None) -> bool:
        """Whether ``conv`` can aggregate through a CSR adjacency here, exactly.

        Needs the conv's fused ``message_and_aggregate`` (``conv.fuse``: PyG sets it for
        ``sum/add/mean/min/max`` aggregation), the default flow, weights that need no gradient
        (CSR values are detached) and, on CUDA, a reduction ``torch.sparse.mm`` implements there.
        """
        if not self.sparse or not getattr(conv, "fuse", False) or getattr(conv, "explain", False):
            return False
        if conv.flow != "source_to_target" or (weight is not None and weight.requires_grad):
            return False
        aggr = getattr(conv, "aggr", None)
        return not (x.device.type != "cpu" and aggr in ("min", "max"))

    def adjacency(self, edge_index: Tensor, weight: Tensor | None, dtype: torch.dtype) -> Tensor:
        """Cached ``[N_r, N_r + H_r]`` CSR ``A^T`` of the local edges (see :mod:`.sparse`)."""
        return self.cache.get(
            (edge_index, weight),
            ("csr", dtype),
            lambda: csr_adjacency(edge_index, weight, self.num_owned, self.num_full, dtype),
        )

    def aggregate(self, adj: Tensor, x: Tensor, reduce: str) -> Tensor | None:
        """``reduce``-aggregation of ``x`` over a CSR built by this context, with cached
        transposes for the backward; ``None`` for reductions it leaves to PyG (max, min)."""
        if reduce in ("add", "sum"):
            op = adj
        elif reduce == "mean":
            op = self.cache.get((adj,), "mean", lambda: mean_operator(adj))
        else:
            return None
        return spmm(op, self.cache.get((op,), "transpose", lambda: csr_transpose(op)), x)

    def hand_over(self, aggregation: Tensor, num_src: int) -> Tensor:
        """A stand-in adjacency for a conv whose aggregation is already computed.

        Returns an empty ``[N_r, num_src]`` CSR (the last one is kept for the same shape, dtype
        and device): passed to the conv's own ``forward`` in place of its adjacency, it
        satisfies PyG's size checks and reaches the patched ``message_and_aggregate``, which
        returns ``aggregation`` (``[N_r, F]``) for it once, instead of aggregating.  Everything else the conv does
        (projections, root term, normalisation) runs as its own code says, once over all
        owned rows.
        """
        key = (self.num_owned, num_src, aggregation.dtype, aggregation.device)
        if self._stand_in is None or self._stand_in[0] != key:
            device = aggregation.device
            csr = _csr(
                torch.zeros(self.num_owned + 1, dtype=torch.int32, device=device),
                torch.empty(0, dtype=torch.int32, device=device),
                torch.empty(0, dtype=aggregation.dtype, device=device),
                (self.num_owned, num_src),
            )
            self._stand_in = (key, csr)
        stand_in = self._stand_in[1]
        self._handoff = (stand_in, aggregation)
        return stand_in

    def take_aggregation(self, adj_t: Any) -> Tensor | None:
        """The aggregation :meth:`hand_over` left for ``adj_t``, once; ``None`` for any other
        adjacency."""
        handoff = self._handoff
        if handoff is None or adj_t is not handoff[0]:
            return None
        self._handoff = None
        return handoff[1]

    def split(
        self, edge_index: Tensor, weight: Tensor | None = None, sparse: bool = False, dtype: torch.dtype = torch.float32
    ) -> SplitBlocks | None:
        """Cached central/marginal blocks of the local edges (:func:`.sparse.split_blocks`),
        or ``None`` when overlap cannot help."""
        return self.cache.get(
            (edge_index, weight),
            ("split", sparse, dtype if sparse else None),
            lambda: split_blocks(edge_index, weight, self.num_owned, self.num_full, sparse, dtype),
        )

    def gcn_norm(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """Local edges with GCN weights computed from GLOBAL degrees (see module docstring).

        Returns:
            ``edge_index [2, E'_r]`` (self-loops added for owned nodes) and ``weight [E'_r]``.
        """
        if edge_weight is not None and edge_weight.requires_grad:
            return self._gcn_norm(edge_index, edge_weight, improved, add_self_loops, dtype)
        return self.cache.get(
            (edge_index, edge_weight),
            ("gcn_norm", improved, add_self_loops, dtype),
            lambda: self._gcn_normalised(edge_index, edge_weight, improved, add_self_loops, dtype),
        )

    def _gcn_normalised(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """:meth:`gcn_norm`'s edges and weights, built afresh from the cached degrees.

        The degrees have their own cache: whichever of :meth:`gcn_norm`,
        :meth:`gcn_adjacency`, :meth:`gcn_split` and :meth:`gcn_score` a rank builds first,
        it exchanges the degrees once, like every other rank.
        """
        deg_inv_sqrt = self._gcn_degrees(edge_index, edge_weight, improved, add_self_loops, dtype)
        return self._gcn_edges(edge_index, edge_weight, improved, add_self_loops, dtype, deg_inv_sqrt)

    def _gcn_norm(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        deg_inv_sqrt = self._gcn_inv_sqrt_degrees(edge_index, edge_weight, improved, add_self_loops, dtype)
        return self._gcn_edges(edge_index, edge_weight, improved, add_self_loops, dtype, deg_inv_sqrt)

    def _gcn_loops(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """The local edges and weights after PyG's self-loop rule (owned nodes only)."""
        # As PyG's gcn_norm: without edge weights the added self-loops weigh 1 even when
        # improved=True (its fill value only applies to weighted graphs).
        fill = 2.0 if improved and edge_weight is not None else 1.0
        if edge_weight is None:
            edge_weight = torch.ones(edge_index.size(1), dtype=dtype, device=edge_index.device)
        if add_self_loops:
            edge_index, edge_weight = add_remaining_self_loops(edge_index, edge_weight, fill, num_nodes=self.num_owned)
        return edge_index, edge_weight

    def _gcn_inv_sqrt_degrees(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> Tensor:
        """``[N_r + H_r]`` inverse square roots of the global degrees (one exact exchange)."""
        edge_index, edge_weight = self._gcn_loops(edge_index, edge_weight, improved, add_self_loops, dtype)
        deg = scatter(edge_weight, edge_index[1], dim=0, dim_size=self.num_owned, reduce="sum")
        del edge_index, edge_weight
        # Halo degrees are only known to their owners: they travel like any other row.
        deg_full = self.exchanger.exchange(deg.unsqueeze(-1), exact=True).squeeze(-1)
        deg_inv_sqrt = deg_full.pow(-0.5)
        return deg_inv_sqrt.masked_fill(deg_inv_sqrt == float("inf"), 0.0)

    def _gcn_edges(
        self,
        edge_index: Tensor,
        edge_weight: Tensor | None,
        improved: bool,
        add_self_loops: bool,
        dtype: torch.dtype,
        deg_inv_sqrt: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """The normalised edge list from :meth:`_gcn_inv_sqrt_degrees`' result (no exchange)."""
        edge_index, edge_weight = self._gcn_loops(edge_index, edge_weight, improved, add_self_loops, dtype)
        row, col = edge_index[0], edge_index[1]
        return edge_index, deg_inv_sqrt[row] * edge_weight * deg_inv_sqrt[col]

    def gcn_adjacency(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> Tensor:
        """Cached ``[N_r, N_r + H_r]`` CSR of :meth:`gcn_norm`'s edges and weights, for edge
        weights that need no gradient (or none).

        Only the CSR matrix and the ``[N_r + H_r]`` inverse square-root degrees are kept: the
        normalised edge list (``[2, E'_r]`` indices and ``[E'_r]`` weights, 20 bytes per edge
        that the fused path never reads) is built, sorted into the CSR and dropped.  The CSR
        is entry for entry the one :meth:`adjacency` builds from :meth:`gcn_norm`'s output.
        """
        def build() -> Tensor:
            ei, weight = self._gcn_normalised(edge_index, edge_weight, improved, add_self_loops, dtype)
            return csr_adjacency(ei, weight, self.num_owned, self.num_full, _csr_dtype_of(dtype))

        return self.cache.get((edge_index, edge_weight), ("gcn_csr", improved, add_self_loops, dtype), build)

    def gcn_split(
        self,
        edge_index: Tensor,
        edge_weight: Tensor | None,
        improved: bool,
        add_self_loops: bool,
        dtype: torch.dtype,
        sparse: bool,
        csr_dtype: torch.dtype,
    ) -> SplitBlocks | None:
        """Cached :meth:`split` of :meth:`gcn_norm`'s edges and weights, for edge weights that
        need no gradient (or none), keeping no normalised edge list beside the blocks.

        The overlap schedule reads only the blocks; :meth:`gcn_norm`'s cached edge list
        (20 bytes per edge) would double what the rank holds for its graph.  The blocks are
        entry for entry those :meth:`split` builds from :meth:`gcn_norm`'s output.
        """

        def build() -> SplitBlocks | None:
            ei, weight = self._gcn_normalised(edge_index, edge_weight, improved, add_self_loops, dtype)
            return split_blocks(ei, weight, self.num_owned, self.num_full, sparse, csr_dtype)

        tag = ("gcn_split", improved, add_self_loops, dtype, sparse, csr_dtype if sparse else None)
        return self.cache.get((edge_index, edge_weight), tag, build)

    def _gcn_degrees(
        self, edge_index: Tensor, edge_weight: Tensor | None, improved: bool, add_self_loops: bool, dtype: torch.dtype
    ) -> Tensor:
        """Cached :meth:`_gcn_inv_sqrt_degrees` (``[N_r + H_r]``: per row, not per edge)."""
        return self.cache.get(
            (edge_index, edge_weight),
            ("gcn_deg", improved, add_self_loops, dtype),
            lambda: self._gcn_inv_sqrt_degrees(edge_index, edge_weight, improved, add_self_loops, dtype),
        )

    def gcn_score(
        self,
        edge_index: Tensor,
        edge_weight: Tensor | None,
        improved: bool,
        add_self_loops: bool,
        dtype: torch.dtype,
        rule: tuple,
    ) -> Callable[[], Tensor]:
        """:meth:`score` of GCN's normalised edges after :meth:`gcn_adjacency` (which keeps
        no edge list): the call rebuilds the edges from the cached degrees (no exchange),
        scores them with ``("sum",)`` and drops them; cached as :meth:`score` caches."""
        sources = (edge_index, edge_weight)
        num_owned, num_halo = self.num_owned, self.exchanger.plan.num_halo

        def build() -> Tensor:
            # A cache hit: gcn_adjacency ran first and its sources are alive (held here).
            ei, weight = self._gcn_normalised(edge_index, edge_weight, improved, add_self_loops, dtype)
            return halo_scores(ei, weight, rule, num_owned, num_halo)

        def score() -> Tensor:
            return self.cache.get(sources, ("score", rule), build)

        return score


# -- aggregation scores -----------------------------------------------------------------


def _score_rule(conv: MessagePassing) -> tuple:
    """The coefficient rule of :meth:`HaloContext.score` for ``conv``."""
    if isinstance(conv, (GATConv, GATv2Conv)):
        return ("softmax", bool(conv.add_self_loops))
    if isinstance(conv, (GINConv, GINEConv)):
        return ("sum",)
    aggr = getattr(conv, "aggr", None)
    if aggr in ("add", "sum"):
        # Known sum convs only: an unknown conv with aggr="add" may weigh its messages
        # (attention convs aggregate softmax-weighted messages with "add").
        return ("sum",) if isinstance(conv, (SAGEConv, GraphConv, GCNConv)) else ("mean",)
    if aggr in ("max", "min"):
        return ("max",)
    return ("mean",)


def halo_scores(
    edge_index: Tensor, weight: Tensor | None, rule: tuple, num_owned: int, num_halo: int
) -> Tensor:
    """``[H]`` float32: per halo row, the sum of its out-edges' coefficients under ``rule``
    (see :meth:`HaloContext.score`); halo row ``j`` is local id ``num_owned + j``."""
    src, dst = edge_index[0], edge_index[1]
    device = edge_index.device
    if weight is None:
        coef = torch.ones(src.numel(), dtype=torch.float32, device=device)
    else:
        coef = weight.detach().abs().to(torch.float32)
    kind = rule[0]
    if kind == "mean":
        count = torch.bincount(dst, minlength=num_owned).to(torch.float32)
        coef = coef / count[dst]
    elif kind == "softmax":
        add_self_loops = rule[1]
        # With self-loops PyG drops the existing ones and adds one per node; a self-loop is
        # never a halo edge, so only the group size changes.
        keep = src != dst if add_self_loops else torch.ones_like(src, dtype=torch.bool)
        count = torch.bincount(dst[keep], minlength=num_owned).to(torch.float32) + float(add_self_loops)
        coef = coef / count[dst]
    elif kind not in ("sum", "max"):
        raise ValueError(f"unknown score rule {rule!r}")
    halo = src >= num_owned
    out = torch.zeros(num_halo, dtype=torch.float32, device=device)
    return out.index_add_(0, src[halo] - num_owned, coef[halo])


# -- adapters ---------------------------------------------------------------------------


def _csr_dtype(x: Tensor) -> torch.dtype:
    """Value dtype of the CSR blocks: float64 for float64 features, else float32 (torch's CSR
    products have no half/bfloat16 kernels; see ``_make_message_and_aggregate``)."""
    return _csr_dtype_of(x.dtype)


def _csr_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32

# Convs whose fused path is exact on a CSR adjacency, and what its values hold: "ones"
# (the conv ignores edge weights: SAGE, GIN) or "edge_weight" (GraphConv's optional weights).
# Exact types only: a subclass may override `message`, which the fused path would bypass.
_SPARSE_VALUES: dict[type, str] = {SAGEConv: "ones", GINConv: "ones", GraphConv: "edge_weight"}


def _bipartite(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    kwargs.pop("size", None)
    values = _SPARSE_VALUES.get(type(conv))
    weight = None
    if values == "edge_weight":
        weight = args[0] if args else kwargs.get("edge_weight")
        rest_args, rest_kwargs = args[1:], {k: v for k, v in kwargs.items() if k != "edge_weight"}
    else:
        rest_args, rest_kwargs = args, kwargs
    # Only GraphConv multiplies its messages by a scalar edge weight.
    score = ctx.score(conv, edge_index, weight if values == "edge_weight" else None)
    if values is not None and not rest_args and not rest_kwargs and ctx.use_sparse(conv, x, weight):
        if _sage_fusable(conv):
            return _sage(conv, ctx, x, edge_index, score)
        # The conv's own fused path (message_and_aggregate -> torch.sparse.mm) on cached CSR blocks.
        if not ctx.overlap or (split := ctx.split(edge_index, weight, sparse=True, dtype=_csr_dtype(x))) is None:
            return forward((ctx.exchange(x, score), x), ctx.adjacency(edge_index, weight, _csr_dtype(x)))
        pending = ctx.exchange_async(x, score)
        if not getattr(conv, "project", False) and getattr(conv, "decomposed_layers", 1) == 1:
            # Aggregate the central rows while the exchange is in flight and the marginal rows
            # after it, then run the conv's own forward once over all owned rows with that
            # aggregation: its root term (lin_r, lin_root, (1 + eps) x) reads `x` itself.  A
            # forward per block would keep gathered copies x[central], x[marginal] of the layer
            # input alive for the backward, one more [N_r, F] per layer.
            # (GraphConv's message_and_aggregate also takes the edge weights: in the CSR values)
            extra = {"edge_weight": None} if values == "edge_weight" else {}
            agg_c = conv.message_and_aggregate(split.central_block, (x, None), **extra)
            x_full = torch.cat([x, pending.wait()], dim=0)
            agg = split.merge(agg_c, conv.message_and_aggregate(split.marginal_block, (x_full, None), **extra))
            del agg_c
            stand_in = ctx.hand_over(agg, x_full.size(0))
            try:
                return forward((x_full, x), stand_in)
            finally:
                ctx.take_aggregation(stand_in)  # never left for a later call, even after an error
        out_c = forward((x, x[split.central]), split.central_block)
        x_full = torch.cat([x, pending.wait()], dim=0)
        out_m = forward((x_full, x[split.marginal]), split.marginal_block)
        return split.merge(out_c, out_m)
    split = ctx.split(edge_index) if ctx.overlap and not args and not kwargs else None
    if split is None:
        return forward((ctx.exchange(x, score), x), edge_index, *args, size=(ctx.num_full, ctx.num_owned), **kwargs)
    # Central rows need no halo: aggregate them while the exchange is in flight.
    pending = ctx.exchange_async(x, score)
    out_c = forward((x, x[split.central]), split.central_block, size=(ctx.num_owned, split.central.numel()))
    x_full = torch.cat([x, pending.wait()], dim=0)
    out_m = forward((x_full, x[split.marginal]), split.marginal_block, size=(ctx.num_full, split.marginal.numel()))
    return split.merge(out_c, out_m)


def _unhooked(module: nn.Module) -> bool:
    # forward (pre-)hooks may rewrite the weights (torch.nn.utils.prune) or read the output
    return not (module._forward_hooks or module._forward_pre_hooks)


def _sage_fusable(conv: MessagePassing) -> bool:
    """Whether :func:`_sage` computes this conv: an exact ``SAGEConv`` with a linear
    aggregation, no ``project`` step, one decomposed layer, initialised weights and no hooks
    on it that the fused arithmetic would bypass."""
    if type(conv) is not SAGEConv or conv.project or conv.decomposed_layers != 1:
        return False
    if conv.aggr not in ("mean", "sum", "add") or getattr(conv, "explain", False):
        return False
    if conv._propagate_forward_pre_hooks or conv._propagate_forward_hooks:
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    lins = [conv.lin_l] + ([conv.lin_r] if conv.root_weight else [])
    return all(
        _unhooked(lin) and not isinstance(lin.weight, nn.parameter.UninitializedParameter) for lin in lins
    )


def _sage(conv: SAGEConv, ctx: HaloContext, x: Tensor, edge_index: Tensor, score: Callable[[], Tensor]) -> Tensor:
    r"""``SAGEConv`` with a linear aggregation :math:`\mathcal{A}` (mean or sum), on the cached
    CSR blocks:

    .. math::
        \mathbf{X}'_r = \mathcal{A}(\mathbf{X}^{full}_r)\, W_l^\top + b_l
        + \mathbf{X}_r W_r^\top
        \quad\text{or, when } F_{out} < F_{in}, \quad
        \mathcal{A}(\mathbf{X}^{full}_r W_l^\top) + b_l + \mathbf{X}_r W_r^\top

    (then PyG's optional L2 ``normalize``).  The same maths as ``SAGEConv.forward``, summed in
    another order, with fewer ``[N_r, F_out]`` temporaries: the root term is added into the
    output in place (``addmm_``) rather than as ``lin_r``'s own output plus a sum, and a layer
    whose ``lin_l`` narrows the rows (the output layer) aggregates the narrower rows
    ``X W_l^T``, projecting the owned and the received rows separately so autograd keeps the
    received ``[H_r, F_in]`` rows, not an ``[N_r + H_r, F_in]`` copy (``X_r`` is kept for the
    root term anyway).  The exchanged message is ``X_r``'s halo rows, as for every conv.

    Shapes:
        x: ``[N_r, F_in]`` -> ``[N_r, F_out]``.
    """
    narrow = x.size(-1) > conv.out_channels
    w_l, b_l = conv.lin_l.weight, conv.lin_l.bias

    def rows(t: Tensor) -> Tensor:  # what the adjacency multiplies
        return torch.nn.functional.linear(t, w_l) if narrow else t

    dtype = _csr_dtype(x)
    split = ctx.split(edge_index, None, sparse=True, dtype=dtype) if ctx.overlap else None
    if split is None:
        halo = ctx.halo(x, score) if narrow else None
        src = torch.cat([rows(x), rows(halo)], dim=0) if narrow else ctx.exchange(x, score)
        del halo
        agg = conv.message_and_aggregate(ctx.adjacency(edge_index, None, dtype), (src, None))
    else:
        # central rows (owned sources) while the halo is in flight, marginal rows after it
        pending = ctx.exchange_async(x, score)
        own = rows(x)
        agg_c = conv.message_and_aggregate(split.central_block, (own, None))
        src = torch.cat([own, rows(pending.wait())], dim=0)
        del own
        agg = split.merge(agg_c, conv.message_and_aggregate(split.marginal_block, (src, None)))
        del agg_c
    del src
    # `out` is a new tensor of this function's own (not the aggregation) where `owned`
    owned = not narrow or b_l is not None
    if narrow:
        # (the bias in the aggregation's dtype, as lin_l's addmm has it under autocast)
        out = agg if b_l is None else agg + b_l.to(agg.dtype)
    else:
        out = torch.nn.functional.linear(agg, w_l, b_l)
    del agg
    if conv.root_weight:
        w_r = conv.lin_r.weight.t()
        if owned and not torch.is_autocast_enabled(x.device.type):
            out = out.addmm_(x, w_r)
        else:
            out = torch.addmm(out, x, w_r)  # autocast covers addmm, not the in-place form
    if conv.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out


def _slice_output(out: Any, n: int) -> Any:
    if isinstance(out, Tensor):
        return out[:n]
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return (out[0][:n],) + tuple(out[1:])
    return out


def _full_then_slice(conv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    if kwargs.get("size") is not None:
        raise ValueError(f"{type(conv).__name__}: do not pass `size=` under FullGraphStrategy; it is set for you")
    x_full = ctx.exchange(x, ctx.score(conv, edge_index))
    return _slice_output(forward(x_full, edge_index, *args, **kwargs), ctx.num_owned)


def _aggregate_first(conv: GCNConv, x: Tensor) -> bool:
    r"""Whether a GCN layer computes :math:`(\hat{A} X) W` rather than PyG's
    :math:`\hat{A} (X W)` (the same matrix, summed in another order; DGL's ``GraphConv`` rule).

    When ``lin`` does not narrow the rows (``F_in <= F_out``), aggregating first keeps only the
    ``[N_r, F_in]`` aggregation for ``lin``'s backward instead of the ``[N_r + H_r, F_in]``
    layer input with its halo rows, and ``lin`` multiplies ``N_r`` rows instead of
    ``N_r + H_r``.  When it narrows (the output layer), transforming first aggregates the
    narrower rows.  The exchanged message is the layer input either way.
    """
    return x.size(-1) <= conv.out_channels


def _gcn_transform(conv: GCNConv, aggregation: Tensor) -> Tensor:
    """``lin`` and bias on an aggregation ``[N_r, F_in] -> [N_r, F_out]``."""
    out = conv.lin(aggregation)
    return out + conv.bias if conv.bias is not None else out


def _gcn(conv: GCNConv, forward, ctx: HaloContext, x: Tensor, edge_index, args: tuple, kwargs: dict):
    edge_weight = args[0] if args else kwargs.pop("edge_weight", None)
    if conv.flow != "source_to_target":
        raise UnsupportedConvError("GCNConv with flow='target_to_source' is not supported by FullGraphStrategy")
    sources = (edge_index, edge_weight)
    rule = ("sum", "gcn", bool(conv.normalize), bool(conv.improved), bool(conv.add_self_loops))
    if (
        conv.normalize
        and not ctx.overlap
        and (edge_weight is None or not edge_weight.requires_grad)
        and ctx.use_sparse(conv, x, edge_weight)
    ):
        # The fused path only reads the CSR: build it from the normalised edges and keep no
        # edge list (same matrix, same score, as the general path below).  The degree exchange
        # runs (once) before the feature exchange, as below.
        adj = ctx.gcn_adjacency(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype)
        score = ctx.gcn_score(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, rule)
        if _aggregate_first(conv, x):
            return _gcn_transform(conv, conv.propagate(adj, x=ctx.exchange(x, score), edge_weight=None))
        normalize, conv.normalize = conv.normalize, False
        try:
            return forward(ctx.exchange(x, score), adj)
        finally:
            conv.normalize = normalize
    split = None
    if conv.normalize and ctx.overlap and (edge_weight is None or not edge_weight.requires_grad):
        # Overlap keeps only the central/marginal blocks, built from the normalised edges,
        # which are then dropped (as gcn_adjacency does); the score is rebuilt on demand.
        sparse = ctx.use_sparse(conv, x, edge_weight)
        split = ctx.gcn_split(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, sparse, _csr_dtype(x))
        score = ctx.gcn_score(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype, rule)
    if split is None:
        if conv.normalize:
            edge_index, weight = ctx.gcn_norm(edge_index, edge_weight, conv.improved, conv.add_self_loops, x.dtype)
        else:
            weight = edge_weight
        # The coefficients are the values aggregated below (global-degree normalisation or the
        # raw weights), cached on the user's tensors and this conv's normalisation options.
        score = ctx.score(conv, edge_index, weight, rule=rule, sources=sources)
        sparse = ctx.use_sparse(conv, x, weight)
        split = ctx.split(edge_index, weight, sparse=sparse, dtype=_csr_dtype(x)) if ctx.overlap else None
    if split is not None:
        # out = A_hat (X W) + b, computed as central rows (owned sources only) while the halo
        # is in flight, then marginal rows; lin is applied once per row, before the
        # aggregation when it narrows the rows and after it otherwise (see _aggregate_first).
        pending = ctx.exchange_async(x, score)
        first = _aggregate_first(conv, x)
        h = x if first else conv.lin(x)
        if sparse:
            out_c = conv.propagate(split.central_block, x=h, edge_weight=None)
        else:
            size_c = (ctx.num_owned, split.central.numel())
            out_c = conv.propagate(split.central_block, x=h, edge_weight=split.central_weight, size=size_c)
        halo = pending.wait()
        h_full = torch.cat([h, halo if first else conv.lin(halo)], dim=0)
        del halo
        if sparse:
            out_m = conv.propagate(split.marginal_block, x=h_full, edge_weight=None)
        else:
            size_m = (ctx.num_full, split.marginal.numel())
            out_m = conv.propagate(split.marginal_block, x=h_full, edge_weight=split.marginal_weight, size=size_m)
        del h_full
        out = split.merge(out_c, out_m)
        if first:
            return _gcn_transform(conv, out)
        return out + conv.bias if conv.bias is not None else out
    # The conv's own code does lin/propagate/bias; only its normalisation is replaced.
    normalize, conv.normalize = conv.normalize, False
    try:
        if sparse:
            return forward(ctx.exchange(x, score), ctx.adjacency(edge_index, weight, _csr_dtype(x)))
        out = forward(ctx.exchange(x, score), edge_index, weight)
    finally:
        conv.normalize = normalize
    return out[: ctx.num_owned]


_ADAPTERS: dict[type, ConvAdapter] = {
    GCNConv: _gcn,
    SAGEConv: _bipartite,
    GINConv: _bipartite,
    GINEConv: _bipartite,
    GraphConv: _bipartite,
    GATConv: _full_then_slice,
    GATv2Conv: _full_then_slice,
}
_KINDS: dict[str, ConvAdapter] = {"bipartite": _bipartite, "full_then_slice": _full_then_slice}


# Registrations made with `register_conv_adapter`, per conv type, in registration order (keyed
# by handle id; the newest one wins, the built-in `_ADAPTERS` entry is the floor).  Ordered
# dicts: `RemovableHandle` holds its dict by weak reference, which a plain dict does not allow.
_REGISTERED: dict[type, OrderedDict[int, ConvAdapter]] = {}


# Convs that propagate more than once per forward, and the attribute holding how often: one
# halo exchange per layer gives their owned rows only the first hop exactly.
_MULTI_HOP: dict[type, str] = {
    ChebConv: "K",
    TAGConv: "K",
    SGConv: "K",
    SSGConv: "K",
    APPNP: "K",
    ARMAConv: "num_layers",
    GatedGraphConv: "num_layers",
    MixHopConv: "powers",
}
_MULTI_HOP_REASON = "multi-hop: needs K halo exchanges per layer, not supported"
_ADAPTER_HELP = (
    "if no output row depends on a neighbour's degree (no GCN-style normalisation), register it as "
    "'full_then_slice'; otherwise write a ConvAdapter callable `adapter(conv, forward, ctx, x, "
    "edge_index, args, kwargs)` and register that (see help(lightning_fullgraph.register_conv_adapter) "
    "and the README, 'Supported layers')"
)


def _with_help(reason: str) -> str:
    """``reason`` and what to do instead; a multi-hop conv gets no registration advice."""
    return reason if _MULTI_HOP_REASON in reason else f"{reason}; {_ADAPTER_HELP}"


def _multi_hop(conv: MessagePassing | type) -> str | None:
    """Why ``conv`` (an instance, or a class) is multi-hop, or ``None``.

    A class is multi-hop when it is one of ``_MULTI_HOP``; an instance when its hop count
    (``K``, ``num_layers`` or ``max(powers)`` for those classes, an integer ``K`` attribute for
    any other) is above 1."""
    cls = conv if isinstance(conv, type) else type(conv)
    attr = next((a for c, a in _MULTI_HOP.items() if issubclass(cls, c)), None)
    if isinstance(conv, type):
        return None if attr is None else f"{cls.__name__} is {_MULTI_HOP_REASON} (its `{attr}` sets the hops)"
    # ChebConv keeps no `K`: one linear map per Chebyshev term.
    hops = len(conv.lins) if isinstance(conv, ChebConv) else getattr(conv, attr or "K", None)
    if isinstance(hops, (list, tuple)) and hops and all(isinstance(h, int) for h in hops):
        hops = max(hops)
    if isinstance(hops, bool) or not isinstance(hops, int) or hops <= 1:
        return None
    return f"{cls.__name__} is {_MULTI_HOP_REASON} ({attr or 'K'}={hops})"


def _may_be_tuple(annotation: Any) -> bool:
    """Whether a parameter annotated ``annotation`` may receive a tuple (``True`` unless it
    names only classes a tuple is not an instance of)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_may_be_tuple(a) for a in typing.get_args(annotation))
    target = origin if origin is not None else annotation
    if isinstance(target, type):
        return issubclass(tuple, target)
    return True  # a form it cannot judge (TypeVar, Annotated, a string it could not resolve)


def _bipartite_refusal(cls: type) -> str | None:
    """Why ``"bipartite"`` cannot run ``cls``, or ``None``.

    :func:`_bipartite` calls ``forward((x_full, x), edge_index_or_adjacency, *args,
    size=(N_r + H_r, N_r), **kwargs)``: ``forward`` must take an ``x`` that may be a tuple and
    a ``size`` keyword (or ``**kwargs``)."""
    name = cls.__name__
    multi = _multi_hop(cls)
    if multi is not None:
        return multi
    try:
        sig = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return None  # nothing to read: the user's call
    params = list(sig.parameters.values())[1:]  # drop `self`
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2:
            return f"{name}.forward takes fewer than two positional arguments (x, edge_index)"
        x = positional[0]
        try:
            hints = typing.get_type_hints(cls.forward)
        except Exception:  # unresolvable string annotations: judge what is there
            hints = {}
        annotation = hints.get(x.name, x.annotation)
        if not isinstance(annotation, str) and not _may_be_tuple(annotation):
            shown = getattr(annotation, "__name__", None) or repr(annotation)
            return (
                f"{name}.forward's `{x.name}` is annotated `{shown}`, not a (x_src, x_dst) tuple, so the "
                f"bipartite adapter cannot pass the [owned | halo] source rows apart from the owned targets"
            )
    size = sig.parameters.get("size")
    if inspect.Parameter.VAR_KEYWORD not in kinds and (size is None or size.kind is size.POSITIONAL_ONLY):
        return f"{name}.forward takes no `size` argument, so the bipartite adapter cannot pass the halo shape"
    return None


def register_conv_adapter(cls: type[MessagePassing], adapter: str | ConvAdapter = "bipartite") -> RemovableHandle:
    """Declares how a conv type is made partition-aware.

    Args:
        cls: A ``MessagePassing`` subclass.
        adapter: ``"bipartite"`` for convs whose ``forward`` accepts an ``(x_src, x_dst)`` tuple
            as ``x`` and ``size=`` (exact when the output at a node depends only on it, its
            in-neighbours and in-edges), ``"full_then_slice"`` for convs that accept only one
            feature matrix but whose owned outputs do not depend on the rows of halo nodes
            beyond their messages (no degree of a neighbour), or a callable
            ``adapter(conv, forward, ctx, x, edge_index, args, kwargs)`` (``forward`` is the
            conv's own; ``ctx`` a :class:`HaloContext`, ``ctx.exchange(x)`` gives the
            ``[N_r + H_r, F]`` rows; the result is the ``N_r`` owned output rows).

    Raises:
        UnsupportedConvError: ``"bipartite"`` for a ``forward`` without ``size`` or whose ``x``
            is annotated as a tensor only, or either kind for a multi-hop conv (``ChebConv``,
            ``TAGConv``, ``SGConv``, ``SSGConv``, ``APPNP``, ``ARMAConv``, ``GatedGraphConv``,
            ``MixHopConv``), with the reason.  A callable is not checked.  At installation,
            a conv registered with a kind whose instance has an integer ``K`` above 1 is
            refused the same way.

    Returns:
        A :class:`torch.utils.hooks.RemovableHandle`: ``handle.remove()`` (idempotent) takes
        this registration away; the type's adapter is then again the one it replaced (an
        earlier registration still in place, else the built-in one, else none).  Also a
        context manager.  Convs already patched keep their adapter until re-installed.
    """
    if not (isinstance(cls, type) and issubclass(cls, MessagePassing)):
        raise TypeError(f"expected a MessagePassing subclass, got {cls!r}")
    if isinstance(adapter, str):
        if adapter not in _KINDS:
            raise ValueError(f"unknown adapter kind {adapter!r}; use one of {sorted(_KINDS)} or a callable")
        reason = _bipartite_refusal(cls) if adapter == "bipartite" else _multi_hop(cls)
        if reason is not None:
            raise UnsupportedConvError(f"cannot register {cls.__name__} as {adapter!r}: {_with_help(reason)}.")
        adapter = _KINDS[adapter]
    elif not callable(adapter):
        raise TypeError(f"adapter must be one of {sorted(_KINDS)} or a callable, got {adapter!r}")
    registrations = _REGISTERED.setdefault(cls, OrderedDict())
    handle = RemovableHandle(registrations)
    registrations[handle.id] = adapter
    return handle


def _adapter_of(cls: type) -> ConvAdapter | None:
    registrations = _REGISTERED.get(cls)
    if registrations:
        return next(reversed(registrations.values()))
    return _ADAPTERS.get(cls)


def supported_convs() -> list[str]:
    """Names of the conv types with an adapter."""
    return sorted({c.__name__ for c in _ADAPTERS} | {c.__name__ for c, r in _REGISTERED.items() if r})


def _find_adapter(conv: MessagePassing) -> ConvAdapter | None:
    for cls in type(conv).__mro__:
        adapter = _adapter_of(cls)
        if adapter is not None:
            return adapter
        if cls is MessagePassing:
            break
    return None


def _split_x_edge_index(args: tuple, kwargs: dict) -> tuple[Any, Any, tuple, dict]:
    args = list(args)
    x = kwargs.pop("x") if "x" in kwargs else args.pop(0)
    edge_index = kwargs.pop("edge_index") if "edge_index" in kwargs else args.pop(0)
    return x, edge_index, tuple(args), kwargs


# Instance attribute holding a patched conv's `_Patch` record (removed with the patch).
_PATCH_ATTR = "_fullgraph_patch"
_MISSING = object()


class _Patch:
    """What :func:`install_adapters` set on one conv's instance dict, and what was there before."""

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: dict[str, Any] = {}

    def set(self, conv: nn.Module, name: str, value: Any) -> None:
        if name not in self.saved:
            self.saved[name] = conv.__dict__.get(name, _MISSING)
        # object.__setattr__: nn.Module.__setattr__ would route Modules/Parameters elsewhere.
        object.__setattr__(conv, name, value)

    def undo(self, conv: nn.Module) -> None:
        for name, before in reversed(self.saved.items()):
            if before is _MISSING:
                conv.__dict__.pop(name, None)
            else:
                conv.__dict__[name] = before
        self.saved.clear()


def _unpatch(conv: nn.Module, patch: _Patch | None = None) -> None:
    """Restores ``conv`` if it carries a patch (only ``patch`` when given)."""
    current = conv.__dict__.get(_PATCH_ATTR)
    if current is None or (patch is not None and current is not patch):
        return
    del conv.__dict__[_PATCH_ATTR]
    current.undo(conv)


class AdapterHandle:
    """The patches :func:`install_adapters` made; ``remove()`` takes them all back.

    After ``remove()`` every conv's instance dict is what it was before installation (an
    instance-level ``forward`` the user had set is put back; attributes that were not there
    are gone).  Idempotent; a conv re-patched since by another installation is left alone.
    Iterating gives the patched convs; also a context manager.
    """

    def __init__(self, patches: list[tuple[MessagePassing, _Patch]]) -> None:
        self._patches = patches

    @property
    def convs(self) -> list[MessagePassing]:
        return [conv for conv, _ in self._patches]

    def __iter__(self):
        return iter(self.convs)

    def __len__(self) -> int:
        return len(self._patches)

    def remove(self) -> None:
        patches, self._patches = self._patches, []
        for conv, patch in reversed(patches):
            _unpatch(conv, patch)

    def __enter__(self) -> AdapterHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def install_adapters(module: nn.Module, ctx: HaloContext) -> AdapterHandle:
    """Patches every ``MessagePassing`` submodule of ``module`` to run on the partition.

    A conv that is already patched (by an earlier installation) is restored first.

    Raises:
        UnsupportedConvError: naming the first conv type without an adapter (nothing is
            patched in that case).

    Returns:
        An :class:`AdapterHandle`; ``handle.remove()`` (or ``uninstall_adapters(handle)``)
        restores every patched conv exactly.
    """
    names = {id(m): n for n, m in module.named_modules()}
    convs = [m for m in module.modules() if isinstance(m, MessagePassing)]
    for conv in convs:
        check_installable(conv)
    patches: list[tuple[MessagePassing, _Patch]] = []
    for conv in convs:
        _unpatch(conv)
        adapter = _find_adapter(conv)
        assert adapter is not None
        # The forward a plain call runs now: an instance-level one if the user set one.
        original = conv.__dict__.get("forward") or types.MethodType(type(conv).forward, conv)
        patch = _Patch()
        patch.set(conv, "forward", _make_forward(conv, original, adapter, names.get(id(conv), "?"), ctx))
        if type(conv) in _SPARSE_VALUES or type(conv) is GCNConv:
            own = conv.__dict__.get("message_and_aggregate") or types.MethodType(
                type(conv).message_and_aggregate, conv
            )
            patch.set(conv, "message_and_aggregate", _make_message_and_aggregate(conv, own, ctx))
        object.__setattr__(conv, _PATCH_ATTR, patch)
        patches.append((conv, patch))
    return AdapterHandle(patches)


def check_installable(conv: MessagePassing) -> None:
    """Raises :class:`UnsupportedConvError` for a conv without an adapter, or registered with
    a kind its instance cannot run (multi-hop, or a ``forward`` without what ``"bipartite"``
    passes); the hint to register it is given only where registration would be accepted."""
    name = type(conv).__name__
    adapter = _find_adapter(conv)
    if adapter is None:
        head = f"{name} cannot be made exact by FullGraphStrategy"
        multi = _multi_hop(conv)
        if multi is not None:
            raise UnsupportedConvError(f"{head}: {multi}. Supported: {', '.join(supported_convs())}.")
        head += f": no partition adapter is registered for it. Supported: {', '.join(supported_convs())}."
        reason = _bipartite_refusal(type(conv))
        if reason is not None:
            raise UnsupportedConvError(f"{head} It cannot be registered as 'bipartite': {_with_help(reason)}.")
        raise UnsupportedConvError(
            f"{head} Its forward takes (x_src, x_dst) tuples and `size=`: if each output row depends only "
            f"on the node and its in-neighbours, register it with "
            f"`lightning_fullgraph.register_conv_adapter({name}, 'bipartite')`."
        )
    if adapter is _bipartite or adapter is _full_then_slice:
        reason = _multi_hop(conv)
        if reason is not None and not isinstance(conv, tuple(_MULTI_HOP)):
            # A `K` of the user's own class: it may mean something else.
            reason += " (if `K` is not its hop count, a callable adapter is not checked)"
        elif reason is None and adapter is _bipartite:
            reason = _bipartite_refusal(type(conv))
        if reason is not None:
            raise UnsupportedConvError(f"{name} cannot be made exact by FullGraphStrategy: {_with_help(reason)}.")


def _make_forward(
    conv: MessagePassing, original: Callable[..., Any], adapter: ConvAdapter, name: str, ctx: HaloContext
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        x, edge_index, rest, kw = _split_x_edge_index(args, kwargs)
        ctx.check_input(conv, x, edge_index)
        out = adapter(conv, original, ctx, x, edge_index, rest, kw)
        if ctx.check_finite:
            _check_finite(out, name, conv, ctx)
        return out

    return forward


def _make_message_and_aggregate(conv: MessagePassing, own: Callable[..., Any], ctx: HaloContext) -> Callable[..., Any]:
    # These convs' own fused step is `spmm(adj_t, x_src, reduce=conv.aggr)`; on the adapters'
    # cached CSR blocks the same product runs with a transpose built once for the backward.
    def message_and_aggregate(adj_t: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        handed_over = ctx.take_aggregation(adj_t)
        if handed_over is not None:
            return handed_over
        if not (isinstance(adj_t, Tensor) and adj_t.layout == torch.sparse_csr):
            return own(adj_t, x, *args, **kwargs)
        src = x[0] if isinstance(x, tuple) else x
        dtype = src.dtype
        # CSR kernels have no half/bfloat16 versions, and autocast ("bf16-mixed") would cast
        # the product's inputs down: it runs in the CSR's dtype with autocast off, and the
        # result goes back to the features' dtype.
        src = src.to(adj_t.dtype)
        with torch.autocast(device_type=src.device.type, enabled=False):
            out = ctx.aggregate(adj_t, src, conv.aggr)
            if out is None:
                out = own(adj_t, (src,) + tuple(x[1:]) if isinstance(x, tuple) else src, *args, **kwargs)
        return out.to(dtype)

    return message_and_aggregate


def _check_finite(out: Any, name: str, conv: nn.Module, ctx: HaloContext) -> None:
    value = out[0] if isinstance(out, tuple) else out
    if isinstance(value, Tensor) and not all_finite(value):
        bad = int((~torch.isfinite(value)).any(dim=-1).sum()) if value.dim() > 1 else int((~torch.isfinite(value)).sum())
        raise FloatingPointError(
            f"rank {ctx.exchanger.plan.rank}: layer '{name}' ({type(conv).__name__}) produced non-finite values "
            f"in {bad} of its {value.size(0)} output rows; training stopped. Lower the learning rate, check "
            f"the input features, or pass FullGraphStrategy(check_finite=False) to skip this check."
        )


def uninstall_adapters(patched: AdapterHandle | Iterable[MessagePassing] | None) -> None:
    """Restores patched convs exactly: ``uninstall_adapters(handle)`` is ``handle.remove()``;
    an iterable of convs (or ``None``/``[]``) is also accepted, each restored if patched."""
    if patched is None:
        return
    if isinstance(patched, AdapterHandle):
        patched.remove()
        return
    for conv in list(patched):
        _unpatch(conv)

r"""The per-rank halo context the patched convs share: exchanges, cached graphs, GCN's degrees.

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

GCN's normalisation needs *global* degrees (see :mod:`.gcn`): :class:`HaloContext` receives the
halo nodes' degrees through the exchange once and caches them with the graphs built from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing
from torch_geometric.utils import add_remaining_self_loops, scatter

from lightning_fullgraph.comm.exchange import HaloExchanger
from lightning_fullgraph.nn.scores import halo_scores, score_rule
from lightning_fullgraph.nn.sparse import (
    DerivedCache,
    SplitBlocks,
    csr_adjacency,
    csr_tensor,
    csr_transpose,
    mean_operator,
    split_blocks,
    spmm,
)

__all__ = ["HaloContext", "csr_dtype"]


class HaloContext:
    """State shared by the patched convs of one module: the exchanger and derived-graph caches.

    Args:
        exchanger: Moves halo rows for this rank.
        overlap: Aggregate central rows while the halo exchange is in flight.
        check_finite: Raise on a non-finite conv output, naming the layer.
        sparse: Aggregate through cached CSR adjacencies (PyG's fused ``message_and_aggregate``
            path) wherever the conv supports it; ``False`` keeps PyG's edge-list path
            (gather ``[E_r, F]`` messages, scatter) everywhere.
        project: Let a layer that projects before aggregating exchange the projected rows
            where they are the narrower message (:meth:`sends_projection`); ``False``: every
            layer exchanges its input (the AdaQP and PipeGCN/Sylvie codes' message).
    """

    def __init__(
        self,
        exchanger: HaloExchanger,
        overlap: bool = False,
        check_finite: bool = False,
        sparse: bool = True,
        project: bool = True,
    ) -> None:
        self.exchanger = exchanger
        self.overlap = overlap
        self.check_finite = check_finite
        self.sparse = sparse
        self.project = project
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

    def exchange(
        self, x: Tensor, score: Callable[[], Tensor] | None = None, source: Tensor | None = None
    ) -> Tensor:
        """``[N_r, F] -> [N_r + H_r, F]``: owned rows followed by the halo rows.

        ``score``: the halo rows' aggregation scores (:meth:`score`), for the exchanger;
        ``source``: the layer input when ``x`` is its projection (:meth:`sends_projection`)."""
        return self.exchanger.exchange(x, score=score, source=source)

    def halo(self, x: Tensor, score: Callable[[], Tensor] | None = None) -> Tensor:
        """``[N_r, F] -> [H_r, F]``: the halo rows alone, what :meth:`exchange` appends."""
        return self.exchanger.halo(x, score=score)

    def exchange_async(
        self, x: Tensor, score: Callable[[], Tensor] | None = None, source: Tensor | None = None
    ) -> Any:
        """Starts the exchange of ``x``'s halo rows; ``.wait()`` gives them (``[H_r, F]``)."""
        return self.exchanger.exchange_async(x, score=score, source=source)

    def sends_projection(self, x: Tensor, out_features: int, weight: Tensor) -> bool:
        r"""Whether a layer that aggregates projected rows, :math:`\hat{A}\,(X W)`, exchanges
        the projected rows :math:`X W` (``[N_r, F_out]``) rather than its input :math:`X`
        (``[N_r, F_in]``): the one rule every adapter that projects before aggregating follows.

        The halo rows are the layer's only traffic and, in the compressed modes, all the codec
        encodes: per halo row :math:`F` values go out and, when the message needs a gradient,
        :math:`F` come back.  So the projection travels when

        .. math::
            F_{out}\,(1 + g_{XW}) < F_{in}\,(1 + g_X),

        with :math:`g = 1` where that tensor needs a gradient in this pass, unless :math:`X`
        is a registered static tensor (the batch's features): those cross the wire once and
        are cached, so they keep travelling as themselves.  On a hidden -> output layer
        (``256 -> C``) this cuts the layer's messages from 256 to ``C`` values per row each way,
        and the receiver no longer projects the halo rows itself (their owners already have).

        Exact in the exact mode: :math:`\hat{A}\,(X W)` is the same matrix whichever rows
        travel (summed in another order).  A compressed mode quantizes (or, in Sylvie's
        asynchronous epochs, keeps from the epoch before) the rows that travel.

        Args:
            x: ``[N_r, F_in]`` the layer input.
            out_features: ``F_out``, the projection's width.
            weight: The projection's weight (its ``requires_grad`` counts).

        Always ``False`` with ``project=False``.
        """
        if not self.project or self.exchanger.is_static(x):
            return False
        grad = torch.is_grad_enabled()
        grad_x = grad and x.requires_grad
        grad_xw = grad_x or (grad and weight.requires_grad)
        return out_features * (1 + grad_xw) < x.size(-1) * (1 + grad_x)

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
            rule: One of the rules above; default :func:`score_rule` of ``conv``.
            sources: The tensors the result is cached on (default ``(edge_index, weight)``).

        Calling it is the only cost: the result is cached per (rule, sources), so every later
        call with the same graph returns the same tensor.
        """
        rule = score_rule(conv) if rule is None else rule
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
            csr = csr_tensor(
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
        """Local edges with GCN weights computed from GLOBAL degrees (see :mod:`.gcn`).

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


def csr_dtype(x: Tensor) -> torch.dtype:
    """Value dtype of the CSR blocks: float64 for float64 features, else float32 (torch's CSR
    products have no half/bfloat16 kernels; see :mod:`.patch`'s ``message_and_aggregate``)."""
    return _csr_dtype_of(x.dtype)


def _csr_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


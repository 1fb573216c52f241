"""``load_dataset``: a dataset name to one normalised node-classification graph.

The name decides the source (:mod:`~lightning_fullgraph.data.datasets.registry`): the
community generator, the products-like generator, or a public dataset read by its PyG / OGB
loader class (:mod:`~lightning_fullgraph.data.datasets.public`).
"""

from __future__ import annotations

import os
from typing import Any

from torch_geometric.data import Data

from lightning_fullgraph.data.datasets import products_like
from lightning_fullgraph.data.datasets.community import community_graph
from lightning_fullgraph.data.datasets.public import load_public
from lightning_fullgraph.data.datasets.registry import (
    SYNTHETIC_NAMES,
    dataset_key,
    dataset_names,
    is_generated_name,
    public_spec,
)

__all__ = ["load_dataset"]


def load_dataset(name: str, root: str | os.PathLike[str] | None = None, **kwargs: Any) -> Data:
    """Load a named node-classification dataset as a single normalised graph.

    Supported names (see :func:`dataset_names`; case-insensitive, ``-`` == ``_``):

    * ``"community"`` / ``"synthetic"``: :func:`community_graph` called with
      ``**kwargs`` (``root`` and ``cache_dir`` are ignored).
    * ``"products-like"``: :func:`~lightning_fullgraph.data.datasets.products_like_graph`, a
      generated graph with ogbn-products' statistics (``num_nodes=...`` scales it at the
      same mean degree; ``root`` and ``cache_dir`` are ignored).
    * ``"Cora"``, ``"CiteSeer"``, ``"PubMed"``: ``Planetoid(root, name)``, public split.
    * ``"cora_ml"``, ``"dblp"``, ``"cora_full"``, ``"citeseer_full"``,
      ``"pubmed_full"``: ``CitationFull(root, name)`` (the ``_full`` names map to
      CitationFull's ``cora`` / ``citeseer`` / ``pubmed``), with a seeded
      Planetoid-style split (``train_per_class`` / ``num_val`` / ``num_test``).
    * ``"roman_empire"``, ``"amazon_ratings"``, ``"minesweeper"``, ``"tolokers"``,
      ``"questions"``: ``HeterophilousGraphDataset(root, name)``, split ``split``
      of the 10 shipped ones.
    * ``"penn94"``, ``"reed98"``, ``"amherst41"``, ``"cornell5"``,
      ``"johnshopkins55"``, ``"genius"``: ``LINKXDataset(root, name)``; shipped
      splits where present (penn94), otherwise a seeded random 50/25/25 split
      over the labelled nodes (``y >= 0``; ``y == -1`` is unlabelled).
    * ``"Actor"``: ``Actor(root)``, split ``split`` of the 10 shipped ones.
    * ``"Reddit"``: ``Reddit(root)``.
    * ``"ogbn-arxiv"``, ``"ogbn-products"``, ``"ogbn-papers100M"``:
      ``ogb.nodeproppred.PygNodePropPredDataset(name, root)`` with masks from
      ``get_idx_split()`` and ``y`` flattened to ``[N]`` (NaN labels become -1).

    ``root`` is the folder the loader class expects (e.g. the one holding
    ``Cora/raw/`` for Planetoid, ``raw/`` itself for Actor).  A parent folder
    holding ``<family>/`` (``Planetoid``, ``CitationFull``, ``Heterophilous``,
    ``LINKX``, ``Actor``, ``Reddit``, ``ogb``) is accepted too.  With
    ``root=None`` the dataset lives (and is downloaded, if the loader can) under
    the cache folder.  If the folder where ``processed/`` would be written is not
    writable, this dataset's raw files are mirrored into the cache folder
    (``<cache>/<family>/...``) and processed there; the root is never written.

    Args:
        name: Dataset name.
        root: Loader root folder, or ``None`` for the cache folder.
        **kwargs: For the synthetic dataset, :func:`community_graph` arguments.
            Otherwise: ``cache_dir`` (writable cache folder; default from the
            ``LIGHTNING_FULLGRAPH_DATA_CACHE`` env var or
            ``~/.cache/lightning-fullgraph/datasets``), ``split`` (int, column of
            multi-split masks, default 0), ``seed`` (int, for generated splits,
            default 0), ``train_per_class`` / ``num_val`` / ``num_test`` (generated
            Planetoid-style splits, default 20 / 500 / 1000) and
            ``planetoid_split`` (Planetoid's ``split`` argument, default
            ``"public"``).

    Returns:
        A :class:`~torch_geometric.data.Data` with ``x`` ``[N, F]`` float32, ``y``
        ``[N]`` int64, ``edge_index`` ``[2, E]`` int64, boolean ``train_mask`` /
        ``val_mask`` / ``test_mask`` ``[N]`` and ``num_nodes``.  Other attributes
        of the source dataset are dropped.

    Raises:
        ValueError: For an unknown name (the message lists the known names) or
            an out-of-range ``split``.
        TypeError: For an unexpected keyword argument.
    """
    if not isinstance(name, str):
        raise ValueError(f"dataset name must be a str, got {name!r}")
    key = dataset_key(name)
    if key in SYNTHETIC_NAMES:
        kwargs.pop("cache_dir", None)
        return community_graph(**kwargs)
    if is_generated_name(name):
        kwargs.pop("cache_dir", None)
        # (looked up in its module at each call, as before the move: tests count the calls)
        return products_like.products_like_graph(**kwargs)
    spec = public_spec(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(dataset_names())}")
    return load_public(spec, root, **kwargs)

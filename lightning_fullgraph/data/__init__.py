"""The graph data of a run: datasets by name, their checks, and the datamodule that partitions them.

* :mod:`~lightning_fullgraph.data.datamodule`: :class:`FullGraphDataModule`, which partitions a
  graph once and gives each rank its own part;
* :mod:`~lightning_fullgraph.data.validation`: the checks of a global graph before it is
  partitioned (:func:`validate_graph`);
* :mod:`~lightning_fullgraph.data.datasets`: the datasets (generated and public), by name.
"""

from lightning_fullgraph.data.datamodule import FullGraphDataModule
from lightning_fullgraph.data.datasets import (
    community_graph,
    dataset_names,
    load_dataset,
    products_like_graph,
)
from lightning_fullgraph.data.validation import GraphValidationError, validate_graph

__all__ = [
    "FullGraphDataModule",
    "GraphValidationError",
    "community_graph",
    "dataset_names",
    "load_dataset",
    "products_like_graph",
    "validate_graph",
]

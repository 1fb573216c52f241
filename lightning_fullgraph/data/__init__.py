"""The graph data of a run: datasets by name, their checks, and the datamodule that partitions them.

* :mod:`~lightning_fullgraph.data.datasets`: the datasets (generated and public), by name.
"""

from lightning_fullgraph.data.datasets import (
    community_graph,
    dataset_names,
    load_dataset,
    products_like_graph,
)

__all__ = [
    "community_graph",
    "dataset_names",
    "load_dataset",
    "products_like_graph",
]

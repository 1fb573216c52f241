"""Node-classification datasets for full-graph training: the public names of this package.

* :func:`load_dataset` (:mod:`.load`): any dataset by name, as one normalised graph;
* :func:`community_graph` (:mod:`.community`): the embedded default dataset, generated;
* :func:`products_like_graph` (:mod:`.products_like`): a generated graph with
  ogbn-products' statistics, in bounded memory;
* :mod:`.public`: the PyG / OGB datasets, read from a root that may be read-only;
* :mod:`.registry`: which names exist and what each one is; :mod:`.splits`: seeded masks.
"""

from lightning_fullgraph.data.datasets.community import community_graph
from lightning_fullgraph.data.datasets.load import load_dataset
from lightning_fullgraph.data.datasets.products_like import (
    GENERATOR_VERSION,
    PRODUCTS_STATS,
    generated_fingerprint,
    products_like_graph,
)
from lightning_fullgraph.data.datasets.public import CACHE_ENV_VAR
from lightning_fullgraph.data.datasets.registry import (
    GENERATED_NAMES,
    dataset_names,
    is_generated_name,
    is_synthetic_name,
)

__all__ = [
    "CACHE_ENV_VAR",
    "GENERATED_NAMES",
    "GENERATOR_VERSION",
    "PRODUCTS_STATS",
    "community_graph",
    "dataset_names",
    "generated_fingerprint",
    "is_generated_name",
    "is_synthetic_name",
    "load_dataset",
    "products_like_graph",
]

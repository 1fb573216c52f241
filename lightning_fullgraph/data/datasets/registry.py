"""The dataset names: which exist, how they compare, and what each one is.

One table for every name :func:`~lightning_fullgraph.data.datasets.load_dataset` accepts:
the synthetic community graph (:data:`SYNTHETIC_NAMES`), the generated products-like graph
(:data:`GENERATED_NAMES`) and the public PyG / OGB datasets (:data:`PUBLIC_SPECS`, with the
loader family each one is read by).  Names compare case-insensitively with ``-`` and ``_``
alike (:func:`dataset_key`).  Nothing here imports torch or builds a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "GENERATED_NAMES",
    "PUBLIC_SPECS",
    "SYNTHETIC_NAMES",
    "DatasetSpec",
    "dataset_key",
    "dataset_names",
    "is_generated_name",
    "is_synthetic_name",
    "public_spec",
]


@dataclass(frozen=True)
class DatasetSpec:
    """A public dataset: the loader that reads it and the name it is known by."""

    family: str  # loader family; also the sub-folder name under a parent root / the cache
    name: str  # name passed to the loader class
    display: str  # canonical public name


#: Names of the embedded community graph (:func:`~lightning_fullgraph.data.datasets.community_graph`).
SYNTHETIC_NAMES: tuple[str, ...] = ("community", "synthetic")

#: Names (case-insensitive, ``-`` == ``_``) under which the generated graph
#: (:func:`~lightning_fullgraph.data.datasets.products_like_graph`) is known to ``load_dataset``.
GENERATED_NAMES: tuple[str, ...] = ("products-like",)

#: The public datasets, read by their real PyG / OGB loader classes
#: (:mod:`~lightning_fullgraph.data.datasets.public`).
PUBLIC_SPECS: list[DatasetSpec] = [
    DatasetSpec("Planetoid", "Cora", "Cora"),
    DatasetSpec("Planetoid", "CiteSeer", "CiteSeer"),
    DatasetSpec("Planetoid", "PubMed", "PubMed"),
    # CitationFull's "cora" / "citeseer" / "pubmed" clash (case-insensitively)
    # with the Planetoid names, so they are exposed with a ``_full`` suffix.
    DatasetSpec("CitationFull", "cora", "cora_full"),
    DatasetSpec("CitationFull", "cora_ml", "cora_ml"),
    DatasetSpec("CitationFull", "citeseer", "citeseer_full"),
    DatasetSpec("CitationFull", "dblp", "dblp"),
    DatasetSpec("CitationFull", "pubmed", "pubmed_full"),
    *(
        DatasetSpec("Heterophilous", n, n)
        for n in ("roman_empire", "amazon_ratings", "minesweeper", "tolokers", "questions")
    ),
    *(
        DatasetSpec("LINKX", n, n)
        for n in ("penn94", "reed98", "amherst41", "cornell5", "johnshopkins55", "genius")
    ),
    DatasetSpec("Actor", "Actor", "Actor"),
    DatasetSpec("Reddit", "Reddit", "Reddit"),
    *(DatasetSpec("ogb", n, n) for n in ("ogbn-arxiv", "ogbn-products", "ogbn-papers100M")),
]


def dataset_key(name: str) -> str:
    """The form in which dataset names compare: stripped, lower case, ``-`` as ``_``."""
    return name.strip().lower().replace("-", "_")


def is_generated_name(name: Any) -> bool:
    """Whether ``name`` names a graph of :mod:`~lightning_fullgraph.data.datasets.products_like`
    (e.g. ``"products-like"``)."""
    return isinstance(name, str) and dataset_key(name) in {dataset_key(n) for n in GENERATED_NAMES}


def is_synthetic_name(name: str) -> bool:
    """Whether ``name`` names a graph this package generates (``"community"``, the
    products-like family): valid by construction, nothing to download."""
    return dataset_key(name) in SYNTHETIC_NAMES or is_generated_name(name)


_BY_KEY: dict[str, DatasetSpec] = {dataset_key(s.display): s for s in PUBLIC_SPECS}
# Unambiguous aliases.
_BY_KEY.update({f"citationfull_{dataset_key(s.name)}": s for s in PUBLIC_SPECS if s.family == "CitationFull"})
_BY_KEY.update({"corafull": _BY_KEY["cora_full"], "film": _BY_KEY["actor"]})


def public_spec(name: str) -> DatasetSpec | None:
    """The public dataset ``name`` names (a canonical name or an alias), or ``None``."""
    return _BY_KEY.get(dataset_key(name))


def dataset_names() -> list[str]:
    """Return the canonical names accepted by :func:`~lightning_fullgraph.data.datasets.load_dataset`.

    Matching is case-insensitive and treats ``-`` and ``_`` alike; a few
    aliases (``"citationfull_cora"``, ``"corafull"``, ``"film"``) are accepted too.

    Returns:
        The names, synthetic and generated ones first.
    """
    return [*SYNTHETIC_NAMES, *GENERATED_NAMES, *(s.display for s in PUBLIC_SPECS)]

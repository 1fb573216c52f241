"""Tests for :func:`lightning_fullgraph.data.datasets.load_dataset`: names, kwargs, synthetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fullgraph.data.datasets import community_graph, dataset_names, load_dataset
from tests.unit.dataset_checks import assert_equal_data as _assert_equal_data


# --------------------------------------------------------------------------- #
# load_dataset: names, kwargs, synthetic
# --------------------------------------------------------------------------- #
def test_dataset_names() -> None:
    names = dataset_names()
    for name in ("community", "synthetic", "Cora", "CiteSeer", "PubMed", "cora_ml", "tolokers"):
        assert name in names
    for name in ("cornell5", "penn94", "Actor", "Reddit", "ogbn-arxiv", "ogbn-products"):
        assert name in names
    assert len(set(n.lower() for n in names)) == len(names)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="known datasets: .*Cora"):
        load_dataset("not-a-dataset")


def test_unknown_kwarg(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        load_dataset("Cora", tmp_path, cache_dir=tmp_path, bogus=1)


def test_load_synthetic() -> None:
    a = load_dataset("community", num_nodes=400, seed=3)
    b = load_dataset("SYNTHETIC", root="/nonexistent", cache_dir="/nonexistent", num_nodes=400, seed=3)
    _assert_equal_data(a, b)
    _assert_equal_data(a, community_graph(num_nodes=400, seed=3))


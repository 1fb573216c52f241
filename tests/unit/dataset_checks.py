"""What a normalised dataset graph is: the checks the dataset tests share."""

from __future__ import annotations

import torch
from torch_geometric.data import Data


def check_normalised(data: Data) -> None:
    n = data.num_nodes
    assert data.x.dtype == torch.float32 and data.x.dim() == 2 and data.x.size(0) == n
    assert data.y.dtype == torch.int64 and data.y.shape == (n,)
    assert data.edge_index.dtype == torch.int64 and data.edge_index.size(0) == 2
    assert int(data.edge_index.max()) < n and int(data.edge_index.min()) >= 0
    masks = [data.train_mask, data.val_mask, data.test_mask]
    for mask in masks:
        assert mask.dtype == torch.bool and mask.shape == (n,)
        assert mask.any()
        assert (data.y[mask] >= 0).all(), "unlabelled nodes must not be in a mask"
    total = sum(mask.long() for mask in masks)
    assert int(total.max()) <= 1, "masks must be disjoint"


def assert_equal_data(a: Data, b: Data) -> None:
    assert a.num_nodes == b.num_nodes
    for key in ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(a[key], b[key]), key

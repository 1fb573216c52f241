"""Seeded random train / validation / test masks over a graph's labelled nodes.

Used where a dataset ships no split of its own: the community generator and CitationFull
(:func:`planetoid_split`), the LINKX sets without shipped masks (:func:`fraction_split`).
Only the ``generator`` passed in is drawn from.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fraction_split", "planetoid_split"]


def planetoid_split(
    y: Tensor,
    num_classes: int,
    train_per_class: int,
    num_val: int,
    num_test: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor]:
    """Planetoid-style random split over labelled nodes (``y >= 0``).

    Returns disjoint boolean masks ``[N]``: ``train_per_class`` nodes per class
    (all of a class if it is smaller), then ``num_val`` and ``num_test`` nodes
    drawn from the remaining labelled nodes (clipped to what is available).
    """
    n = y.numel()
    labelled = (y >= 0).nonzero().view(-1)
    perm = labelled[torch.randperm(labelled.numel(), generator=generator)]
    perm_y = y[perm]
    # A stable sort by class keeps the random order inside each class.
    by_class = torch.sort(perm_y, stable=True)
    counts = torch.bincount(perm_y, minlength=num_classes)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(perm.numel()) - starts[by_class.values]
    train_mask = torch.zeros(n, dtype=torch.bool)
    train_mask[perm[by_class.indices[rank < train_per_class]]] = True

    rest = perm[~train_mask[perm]]  # still in random order
    n_val = min(num_val, rest.numel())
    n_test = min(num_test, rest.numel() - n_val)
    val_mask = torch.zeros(n, dtype=torch.bool)
    val_mask[rest[:n_val]] = True
    test_mask = torch.zeros(n, dtype=torch.bool)
    test_mask[rest[n_val : n_val + n_test]] = True
    return train_mask, val_mask, test_mask


def fraction_split(
    y: Tensor, train: float, val: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``train`` / ``val`` / rest split over labelled nodes (``y >= 0``)."""
    n = y.numel()
    labelled = (y >= 0).nonzero().view(-1)
    perm = labelled[torch.randperm(labelled.numel(), generator=generator)]
    n_train = int(train * perm.numel())
    n_val = int(val * perm.numel())
    masks = [torch.zeros(n, dtype=torch.bool) for _ in range(3)]
    masks[0][perm[:n_train]] = True
    masks[1][perm[n_train : n_train + n_val]] = True
    masks[2][perm[n_train + n_val :]] = True
    return masks[0], masks[1], masks[2]

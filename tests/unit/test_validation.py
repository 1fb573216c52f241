"""Unit tests for lightning_fullgraph.data.validation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from lightning_fullgraph.data.validation import GraphValidationError, all_finite, validate_graph
from lightning_fullgraph.partition.cache import graph_fingerprint

N = 10  # nodes of the base graph
E = 24  # edges of the base graph


def make_graph(**overrides: object) -> Data:
    """A small valid graph with every checked attribute; ``overrides`` replace attributes
    (a value of ``None`` removes the attribute)."""
    g = torch.Generator().manual_seed(0)
    attrs: dict[str, object] = {
        "x": torch.randn(N, 4, generator=g),
        "y": torch.randint(0, 3, (N,), generator=g),
        "edge_index": torch.randint(0, N, (2, E), generator=g),
        "edge_weight": torch.rand(E, generator=g),
        "edge_attr": torch.randn(E, 2, generator=g),
        "train_mask": torch.arange(N) < 4,
        "val_mask": (torch.arange(N) >= 4) & (torch.arange(N) < 7),
        "test_mask": torch.arange(N) >= 7,
        "num_nodes": N,
    }
    attrs.update(overrides)
    return Data(**{k: v for k, v in attrs.items() if v is not None})


def raises(data: Data, match: str, **kwargs: object) -> None:
    with pytest.raises(GraphValidationError, match=match):
        validate_graph(data, **kwargs)


# --------------------------------------------------------------------------- all_finite


def _with(value: float, at: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.randn(64, 8).to(dtype)
    t.view(-1)[at] = value
    return t


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(64, 8),
        _with(float("nan")),
        _with(float("inf")),
        _with(float("-inf")),
        torch.tensor([float("inf"), float("-inf"), 1.0]),  # the sum is NaN, not inf
        torch.full((64, 8), 3.0e38),  # finite, but the float32 sum overflows to inf
        torch.full((16,), 6.0e4, dtype=torch.float16),  # the same in half precision
        torch.full((4,), 1.0e308, dtype=torch.float64).clone().index_fill_(0, torch.tensor([3]), float("nan")),
        _with(float("nan"), dtype=torch.bfloat16),
        _with(float("inf"), at=0, dtype=torch.float64),
        torch.randn(0, 8),
        torch.arange(10),
        torch.ones(3, dtype=torch.bool),
    ],
)
def test_all_finite_agrees_with_isfinite(t: torch.Tensor) -> None:
    """``all_finite`` answers what ``torch.isfinite(t).all()`` answers, including the cases
    the sum shortcut could get wrong: inf and -inf cancelling to NaN, and finite values whose
    sum overflows.  Negative control: returning ``bool(torch.isfinite(t.sum()))`` alone fails
    both overflow cases."""
    assert all_finite(t) == bool(torch.isfinite(t).all())


def test_all_finite_allocates_no_tensor_of_the_input_size() -> None:
    """The check every conv output passes through once per step reads its input once and
    allocates nothing of its size (``isfinite(t).all()`` allocates ``|t|`` and three bool
    masks: 9 ns/element and fresh pages every call).  Negative control: implementing
    ``all_finite`` as ``bool(torch.isfinite(t).all())`` fails (largest allocation = ``t``)."""
    from torch.profiler import ProfilerActivity, profile

    t = torch.randn(4096, 128)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert all_finite(t)
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < t.numel() // 64, f"all_finite allocated {largest} bytes for a {t.nbytes}-byte input"


# --------------------------------------------------------------------------- valid graphs


def test_valid_graph_passes() -> None:
    validate_graph(make_graph())
    validate_graph(make_graph(), num_parts=1)
    validate_graph(make_graph(), num_parts=N)
    validate_graph(make_graph(), num_parts=np.int64(2))  # numpy ints count as ints


def test_minimal_valid_graphs_pass() -> None:
    # Only edges and a node count, no features or masks: fine without require_train.
    validate_graph(Data(edge_index=torch.tensor([[0, 1], [1, 2]]), num_nodes=3), require_train=False)
    # No edges at all, int32 edge_index, [N, 1] labels, [N, S] multi-split masks.
    validate_graph(
        make_graph(
            edge_index=torch.empty(2, 0, dtype=torch.int32),
            edge_weight=torch.empty(0),
            edge_attr=torch.empty(0, 2),
            y=torch.zeros(N, 1, dtype=torch.long),
            val_mask=torch.ones(N, 5, dtype=torch.bool),
        ),
        num_parts=3,
    )


def test_custom_mask_key() -> None:
    data = make_graph(train_mask=torch.zeros(N, dtype=torch.bool), my_mask=torch.arange(N) == 3)
    validate_graph(data, mask_key="my_mask")
    raises(data, r"train_mask has no True entry")
    raises(make_graph(my_mask=torch.arange(N)), r"my_mask .*index_to_mask", mask_key="my_mask")


def test_large_finite_values_pass() -> None:
    # The sum overflows to inf although every value is finite: must not be reported.
    x = torch.full((N, 4), 3.0e38)
    validate_graph(make_graph(x=x))


def test_data_not_modified() -> None:
    data = make_graph(x=make_graph().x.clone())
    before_keys = set(data.keys())
    before_tensors = {k: data[k] for k in before_keys}
    before_copy = copy.deepcopy(data)
    before_fp = graph_fingerprint(data)
    validate_graph(data, num_parts=2)
    assert set(data.keys()) == before_keys
    for key, value in before_tensors.items():
        assert data[key] is value  # same objects, not replaced
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, before_copy[key]) and value.dtype == before_copy[key].dtype
    assert graph_fingerprint(data) == before_fp
    # ... also when validation fails.
    bad = make_graph(x=torch.full((N, 4), float("nan")))
    fp = graph_fingerprint(bad)
    with pytest.raises(GraphValidationError):
        validate_graph(bad)
    assert graph_fingerprint(bad) == fp


def test_is_a_value_error() -> None:
    assert issubclass(GraphValidationError, ValueError)


# --------------------------------------------------------------------------- graph and num_parts


def test_not_data() -> None:
    raises({"edge_index": torch.zeros(2, 1, dtype=torch.long)}, r"expected a torch_geometric.data.Data")


@pytest.mark.filterwarnings("ignore:Unable to accurately infer:UserWarning")
def test_num_nodes_none() -> None:
    raises(Data(), r"graph is empty: data.num_nodes is None")


def test_num_nodes_zero() -> None:
    raises(Data(edge_index=torch.empty(2, 0, dtype=torch.long), num_nodes=0), r"graph is empty.*num_nodes=0")


def test_num_parts_below_one() -> None:
    raises(make_graph(), r"num_parts must be >= 1, got 0", num_parts=0)


def test_num_parts_not_int() -> None:
    raises(make_graph(), r"num_parts must be an int, got float", num_parts=2.0)


def test_num_parts_above_num_nodes() -> None:
    raises(make_graph(), rf"num_parts=11 exceeds num_nodes={N}", num_parts=N + 1)


# --------------------------------------------------------------------------- edge_index


def test_edge_index_missing() -> None:
    raises(make_graph(edge_index=None), r"edge_index is missing")


def test_edge_index_not_tensor() -> None:
    raises(make_graph(edge_index=[[0, 1], [1, 2]]), r"edge_index must be a torch.Tensor.*got list")


def test_edge_index_wrong_dtype() -> None:
    raises(
        make_graph(edge_index=make_graph().edge_index.float()),
        r"dtype torch.int64 or torch.int32.*\.long\(\)",
    )


def test_edge_index_wrong_shape() -> None:
    raises(
        make_graph(edge_index=make_graph().edge_index.t()), rf"shape \[2, E\], got shape \[{E}, 2\].*\.t\(\)"
    )


def test_edge_index_negative_ids() -> None:
    edge_index = make_graph().edge_index.clone()
    edge_index[0, 5] = -3
    raises(make_graph(edge_index=edge_index), r"negative node ids \(min id -3, max id \d+\)")


def test_edge_index_out_of_range() -> None:
    edge_index = make_graph().edge_index.clone()
    edge_index[1, 7] = N + 5
    raises(
        make_graph(edge_index=edge_index), rf"out of range \[0, num_nodes={N}\): min id \d+, max id {N + 5}"
    )


# --------------------------------------------------------------------------- node attributes


def test_x_wrong_length() -> None:
    raises(make_graph(x=torch.randn(N - 1, 4)), rf"data.x has shape \[{N - 1}, 4\].*num_nodes={N}")


def test_x_not_floating() -> None:
    raises(make_graph(x=torch.ones(N, 4, dtype=torch.long)), r"data.x must be a floating tensor.*\.float\(\)")


def test_x_nan() -> None:
    x = make_graph().x.clone()
    x[3, 1] = float("nan")
    x[6, 0] = float("nan")
    x[6, 2] = float("nan")
    raises(
        make_graph(x=x),
        r"data.x holds 3 non-finite value\(s\) \(3 NaN, 0 inf\) in 2 node\(s\), the first at node index 3",
    )


def test_x_inf() -> None:
    x = make_graph().x.clone()
    x[8, 3] = float("-inf")
    raises(
        make_graph(x=x), r"data.x holds 1 non-finite .*\(0 NaN, 1 inf\).*first at node index 8.*nan_to_num"
    )


def test_y_wrong_length() -> None:
    raises(
        make_graph(y=torch.zeros(N + 2, dtype=torch.long)), rf"data.y has shape \[{N + 2}\].*num_nodes={N}"
    )


@pytest.mark.parametrize("key", ["train_mask", "val_mask", "test_mask"])
def test_mask_wrong_length(key: str) -> None:
    raises(make_graph(**{key: torch.ones(N - 3, dtype=torch.bool)}), rf"data.{key} has shape \[{N - 3}\]")


@pytest.mark.parametrize("key", ["train_mask", "val_mask", "test_mask"])
def test_mask_index_tensor(key: str) -> None:
    raises(make_graph(**{key: torch.tensor([0, 2, 5])}), rf"data.{key} has dtype torch.int64.*index_to_mask")


def test_mask_float() -> None:
    raises(make_graph(val_mask=torch.ones(N)), r"data.val_mask has dtype torch.float32.*must be bool")


def test_no_training_node() -> None:
    data = make_graph(train_mask=torch.zeros(N, dtype=torch.bool))
    raises(data, r"train_mask has no True entry: there is no training node anywhere")
    validate_graph(data, require_train=False)


def test_multi_split_masks_raw_accepted_training_sees_one_split() -> None:
    """A raw ``[N, S]`` graph validates; ``select_mask_split`` (what FullGraphDataModule(split=k)
    runs before validating and partitioning) hands validation and training ``[N]`` masks, and
    ``require_train`` then applies to that split alone.  Negative control: the raw graph passes
    although its column 1 has no training node; only the selected split is refused."""
    from lightning_fullgraph.data.datamodule import select_mask_split

    train = torch.zeros(N, 3, dtype=torch.bool)
    train[:4, 0] = True
    train[5:, 2] = True
    data = make_graph(train_mask=train, val_mask=~train, test_mask=torch.ones(N, 3, dtype=torch.bool))
    validate_graph(data)
    for k in (0, 2):
        one = select_mask_split(data, k)
        validate_graph(one)
        for key in ("train_mask", "val_mask", "test_mask"):
            assert one[key].shape == (N,) and torch.equal(one[key], data[key][:, k]), (k, key)
    raises(select_mask_split(data, 1), r"train_mask has no True entry")
    assert data.train_mask.shape == (N, 3), "the raw graph is not modified"
    # Masks that are not [N, S] are left to validate_graph, which names the problem; a float
    # [N, S] mask is refused by select_mask_split itself, with validate_graph's message.
    raises(select_mask_split(make_graph(val_mask=torch.ones(N - 1, 2, dtype=torch.bool)), 0),
           rf"data.val_mask has shape \[{N - 1}, 2\]")
    with pytest.raises(GraphValidationError, match=r"val_mask has dtype torch.float32.*val_mask != 0"):
        select_mask_split(make_graph(val_mask=torch.ones(N, 2)), 0)


def test_train_mask_missing() -> None:
    data = make_graph(train_mask=None)
    raises(data, r"train_mask is missing.*require_train=False")
    validate_graph(data, require_train=False)


# --------------------------------------------------------------------------- edge attributes


@pytest.mark.parametrize("key", ["edge_weight", "edge_attr"])
def test_edge_attr_wrong_length(key: str) -> None:
    raises(make_graph(**{key: torch.rand(E - 1)}), rf"data.{key} has shape \[{E - 1}\].*E={E} edges")


@pytest.mark.parametrize("key", ["edge_weight", "edge_attr"])
def test_edge_attr_non_finite(key: str) -> None:
    value = make_graph()[key].clone()
    value[11] = float("inf")
    value[13] = float("nan")
    raises(make_graph(**{key: value}), rf"data.{key} holds .*in 2 edge\(s\), the first at edge index 11")

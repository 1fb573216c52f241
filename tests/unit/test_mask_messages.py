"""What a wrong node mask is told (issue 29, item 6): a float or integer ``[N, S]`` mask is
named as such with the conversion for every ``split`` (not "no multi-split mask"), and a split
without a training node names the split and the mask.  The same messages come from the
datamodule (``prepare_data``/``setup``) and from the launcher's check before any rank starts
(:func:`lightning_fullgraph.launch.preflight.check_data`)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.data.datamodule import select_mask_split
from lightning_fullgraph.data.validation import GraphValidationError, validate_graph
from lightning_fullgraph.launch.preflight import check_data
from tests.helpers import directed_graph

S = 3


def _multi_split(dtype: torch.dtype = torch.bool, empty_train_split: int | None = None):
    data = directed_graph()
    g = torch.Generator().manual_seed(5)
    train = torch.rand(int(data.num_nodes), S, generator=g) < 0.4
    if empty_train_split is not None:
        train[:, empty_train_split] = False
    data.train_mask, data.val_mask, data.test_mask = train, ~train, ~train
    for key in ("train_mask", "val_mask", "test_mask"):
        data[key] = data[key].to(dtype)
    return data


def _raised(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("split", [0, 1, 2])
def test_a_non_bool_multi_split_mask_is_named_with_the_conversion_for_every_split(
    tmp_path, dtype, split
) -> None:
    """Negative control: the former ``select_mask_split`` considered only bool ``[N, S]`` masks
    multi-split -> ``split=1``/``2`` said "the graph has no multi-split [N, S] node mask" (false)
    and integer masks were called index tensors ("convert with index_to_mask") -> this test
    fails for those parameters."""
    data = _multi_split(dtype)
    dtype_name = str(dtype)
    calls = {
        "select_mask_split": lambda: select_mask_split(data, split),
        "prepare_data": lambda: FullGraphDataModule(data, split=split, cache_dir=tmp_path).prepare_data(),
        "setup": lambda: FullGraphDataModule(data, split=split, cache_dir=tmp_path).setup(),
        "preflight": lambda: check_data(FullGraphDataModule(data, split=split, cache_dir=tmp_path), 2, True),
    }
    messages = {where: _raised(call) for where, call in calls.items()}
    for where, message in messages.items():
        assert "no multi-split" not in message, (where, message)
        assert "index_to_mask" not in message, (where, message)
        assert re.search(
            rf"data\.train_mask has dtype {re.escape(dtype_name)} and shape \[64, 3\]", message
        ), (
            where,
            message,
        )
        assert "data.train_mask = data.train_mask != 0" in message, (where, message)
        assert f"split={split}" in message, (where, message)
    assert len(set(messages.values())) == 1, messages  # one message, wherever it is found
    assert not any(tmp_path.iterdir()), "nothing was partitioned"


def test_validate_graph_gives_the_same_conversion_for_a_float_mask() -> None:
    """``validate_graph`` on the raw graph (no split chosen) says the same about the mask."""
    data = _multi_split(torch.float32)
    message = _raised(lambda: validate_graph(data))
    assert "data.train_mask has dtype torch.float32 and shape [64, 3]" in message
    assert "data.train_mask = data.train_mask != 0" in message
    one = directed_graph()
    one.val_mask = one.val_mask.float()
    assert "data.val_mask = data.val_mask != 0" in _raised(lambda: validate_graph(one))
    index = directed_graph()
    index.test_mask = index.test_mask.nonzero().flatten()  # an index tensor keeps its advice
    assert "index_to_mask" in _raised(lambda: validate_graph(index))


@pytest.mark.parametrize("split", [0, 2])
def test_a_split_without_training_node_is_named(tmp_path, split) -> None:
    """Negative control: the former message, "data.train_mask has no True entry: there is no
    training node anywhere in the graph", names neither the split nor the [N, S] mask it came
    from -> this test fails."""
    data = _multi_split(empty_train_split=split)
    calls = {
        "prepare_data": lambda: FullGraphDataModule(data, split=split, cache_dir=tmp_path).prepare_data(),
        "preflight": lambda: check_data(FullGraphDataModule(data, split=split, cache_dir=tmp_path), 2, True),
    }
    messages = {where: _raised(call) for where, call in calls.items()}
    for where, message in messages.items():
        assert f"data.train_mask[:, {split}]" in message, (where, message)
        assert f"split={split}" in message and "choose another split" in message, (where, message)
        assert "anywhere in the graph" not in message, (where, message)
        assert "require_train=False" in message, (where, message)
    assert len(set(messages.values())) == 1, messages
    # Another split of the same graph trains.
    FullGraphDataModule(data, split=(split + 1) % S, num_parts=2, cache_dir=tmp_path).prepare_data()


def test_a_single_split_graph_without_training_node_keeps_its_message(tmp_path) -> None:
    data = directed_graph()
    data.train_mask = torch.zeros_like(data.train_mask)
    message = _raised(lambda: FullGraphDataModule(data, cache_dir=tmp_path).prepare_data())
    assert "data.train_mask has no True entry: there is no training node anywhere in the graph" in message
    assert "split" not in message.split(";")[0]
    with pytest.raises(GraphValidationError, match="split=4 of"):
        validate_graph(data, split=4)

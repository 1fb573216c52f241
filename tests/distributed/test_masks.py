"""Multi-split node masks (``[N, S]``, as tolokers, Actor, WikiCS and the LINKX sets ship them).

``FullGraphDataModule(split=k)`` keeps column ``k`` of every ``[N, S]`` mask before the graph
is fingerprinted and partitioned: exact mode then equals single-process training on
``mask[:, k]``, each split has its own partition cache folder, an out-of-range split is
refused naming ``S``, and the model helpers refuse a 2-D mask instead of indexing with it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data

import lightning_fullgraph.data.datamodule as datamodule_module
from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.models import GNNNodeClassifier
from lightning_fullgraph.partition.cache import ensure_partitions, load_part
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph, reference_training

STEPS = 4
S = 3


def multi_split_graph(seed: int = 0) -> Data:
    """``directed_graph`` with ``[N, 3]`` train/val/test masks whose columns all differ."""
    data = directed_graph(seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    n = int(data.num_nodes)
    # Column k: a different random subset and density (30%, 45%, 60%) of training nodes.
    train = torch.stack([torch.rand(n, generator=g) < 0.3 + 0.15 * k for k in range(S)], dim=1)
    test = torch.rand(n, S, generator=g) < 0.5
    data.train_mask, data.val_mask, data.test_mask = train, ~train & ~test, ~train & test
    for key in ("train_mask", "val_mask", "test_mask"):
        columns = data[key].t()
        assert all(not torch.equal(columns[i], columns[j]) for i in range(S) for j in range(i)), key
    return data


def one_split(data: Data, k: int) -> Data:
    """The single-split graph a user would train on in one process: ``mask[:, k]``."""
    out = copy.copy(data)
    for key in ("train_mask", "val_mask", "test_mask"):
        out[key] = data[key][:, k].clone()
    return out


# ------------------------------------------------------------------ exactness per split
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("world_size", "split"), [(2, 0), (3, 2)])
def test_exact_mode_equals_single_process_on_the_chosen_split(world_size: int, split: int, tmp_path) -> None:
    """Weights after exact-mode training with ``split=k`` equal single-process training on
    ``mask[:, k]``.  Negative control: the reference weights of the other split differ, so a
    datamodule that trained any other column (or counted all S columns when weighting the
    ranks, the reported bug) cannot pass."""
    data = multi_split_graph(seed=world_size)
    torch.manual_seed(0)
    model = NodeClassifier(conv="gcn", layer_norm=True, num_layers=3)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_training(copy.deepcopy(model), one_split(data, split), STEPS)
    other = reference_training(copy.deepcopy(model), one_split(data, 2 - split), STEPS)
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "training must move the weights"
    assert any(not torch.allclose(other[k], expected[k]) for k in expected), "the splits must train differently"

    dm = FullGraphDataModule(data, split=split, cache_dir=tmp_path)
    cpu_trainer(world_size, max_epochs=STEPS).fit(model, datamodule=dm)

    assert data.train_mask.shape == (data.num_nodes, S), "the user's graph is not modified"
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], msg=lambda m, k=key: f"split={split} {k}: {m}")


class _SelectsItsSplit(NodeClassifier):
    """A module that picks column ``split`` of ``[N, S]`` masks itself (as PyG's examples
    do), so training runs even when the datamodule passes the masks through unselected."""

    def __init__(self, split: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.split = split

    def training_step(self, batch: Data, batch_idx: int) -> torch.Tensor:
        mask = batch.train_mask[:, self.split] if batch.train_mask.dim() == 2 else batch.train_mask
        out = self(batch.x, batch.edge_index)
        return F.cross_entropy(out[mask], batch.y[mask])


@pytest.mark.timeout(180)
def test_without_the_selection_training_is_wrong_or_refused(tmp_path, monkeypatch) -> None:
    """Negative control of the fix: with the selection disabled, ``[N, S]`` masks reach the
    strategy, which weights the ranks by all S columns: the weights differ from the
    single-process ones (the reported silent mismatch), or the run is refused with a
    message naming ``split`` (once the strategy refuses 2-D masks).  Never a silent match."""
    data = multi_split_graph(seed=3)
    torch.manual_seed(0)
    model = _SelectsItsSplit(split=1, conv="gcn", layer_norm=True, num_layers=3)
    expected = reference_training(copy.deepcopy(model), one_split(data, 1), STEPS)
    monkeypatch.setattr(datamodule_module, "select_mask_split", lambda data, split=0, mask_keys=(): data)
    dm = FullGraphDataModule(data, cache_dir=tmp_path)  # split=0: a no-op on the module's column 1
    try:
        cpu_trainer(3, max_epochs=STEPS).fit(model, datamodule=dm)
    except Exception as err:  # the strategy's 2-D mask check; with fork it may surface wrapped
        assert isinstance(err, ValueError) or "ValueError" in str(err), err
        assert "split" in str(err), err
        return
    assert any(not torch.allclose(model.state_dict()[k], expected[k]) for k in expected), (
        "unselected [N, S] masks matched single-process training: this control no longer shows the bug"
    )


# ------------------------------------------------------------- refusals and the cache
def test_split_out_of_range_is_refused_naming_s(tmp_path) -> None:
    data = multi_split_graph()
    with pytest.raises(ValueError, match=r"S=3 splits.*split=3 is out of range"):
        FullGraphDataModule(data, split=3, num_parts=2, cache_dir=tmp_path).prepare_data()
    with pytest.raises(ValueError, match=r"S=3 splits.*split=7"):
        FullGraphDataModule(data, split=7, cache_dir=tmp_path).setup("fit")
    # Single-split masks: any split but 0 names a split that does not exist.
    with pytest.raises(ValueError, match=r"split=1 but the graph has no multi-split"):
        FullGraphDataModule(directed_graph(), split=1, cache_dir=tmp_path).prepare_data()
    for bad in (-1, 1.0, True, "0"):
        with pytest.raises(ValueError, match="split must be a non-negative int"):
            FullGraphDataModule(data, split=bad)
    # One option: a different split in dataset_kwargs is a conflict, the same one is fine.
    with pytest.raises(ValueError, match=r"conflicts with split=0"):
        FullGraphDataModule("tolokers", dataset_kwargs={"split": 2})
    assert FullGraphDataModule("tolokers", split=2, dataset_kwargs={"split": 2}).dataset_kwargs == {}
    assert not any(tmp_path.iterdir()), "nothing was partitioned"


def test_each_split_has_its_own_cache_folder(tmp_path) -> None:
    """Negative control: without the selection both runs hash the same ``[N, S]`` graph into
    the same fingerprint, so the second split would reuse the first one's folder."""
    data = multi_split_graph()
    results = {}
    for split in (0, 2):
        dm = FullGraphDataModule(data, split=split, num_parts=2, cache_dir=tmp_path)
        dm.prepare_data()
        assert dm.partition_result is not None and dm.partition_result.rebuilt, split
        results[split] = dm.partition_result.folder
        for rank in range(2):
            part = load_part(results[split], rank).data
            for key in ("train_mask", "val_mask", "test_mask"):
                assert torch.equal(part[key], data[key][part.n_id, split]), (split, rank, key)
    assert results[0] != results[2]
    again = FullGraphDataModule(data, split=2, num_parts=2, cache_dir=tmp_path)
    again.prepare_data()
    assert again.partition_result is not None and not again.partition_result.rebuilt
    assert again.partition_result.folder == results[2]


def test_a_partition_folder_with_multi_split_masks_is_selected_per_rank(tmp_path) -> None:
    data = multi_split_graph()
    folder = ensure_partitions(data, 1, cache_root=tmp_path).folder  # written with [N, 3] masks
    dm = FullGraphDataModule(str(folder), split=2)
    dm.setup("fit")
    assert dm.local_partition is not None
    local = dm.local_partition.data
    for key in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(local[key], data[key][local.n_id, 2]), key
    with pytest.raises(ValueError, match="S=3 splits"):
        FullGraphDataModule(str(folder), split=3).setup("fit")
    single = ensure_partitions(directed_graph(), 1, cache_root=tmp_path).folder
    with pytest.raises(ValueError, match="partition folder .* holds single-split"):
        FullGraphDataModule(str(single), split=1).setup("fit")


def test_named_dataset_gets_the_split(shared_datasets, tmp_path) -> None:
    """``FullGraphDataModule("tolokers", split=k)`` trains ``load_dataset(split=k)``'s masks."""
    from lightning_fullgraph.data.datasets import load_dataset

    root = shared_datasets / "Heterophilous"
    folders = {}
    for split in (0, 3):
        dm = FullGraphDataModule("tolokers", root=root, split=split, num_parts=1, cache_dir=tmp_path / "parts",
                                 dataset_kwargs={"cache_dir": tmp_path / "data"})
        dm.setup("fit")
        ref = load_dataset("tolokers", root, cache_dir=tmp_path / "data", split=split)
        assert dm.local_partition is not None
        assert torch.equal(dm.local_partition.data.train_mask, ref.train_mask[dm.local_partition.data.n_id])
        folders[split] = dm.manifest["fingerprint"]
    assert folders[0] != folders[3]
    with pytest.raises(ValueError, match="10 splits"):
        FullGraphDataModule("tolokers", root=root, split=10, num_parts=1, cache_dir=tmp_path / "parts",
                            dataset_kwargs={"cache_dir": tmp_path / "data"}).prepare_data()


# --------------------------------------------------------------------- model helpers
def test_model_helpers_refuse_masks_of_another_shape() -> None:
    """``GNNNodeClassifier`` raises on an ``[N, S]`` mask or an index tensor instead of
    indexing with it.  Negative control: the same call with the ``[N]`` column works."""
    n, c = 12, 3
    out, y = torch.randn(n, c), torch.randint(0, c, (n,))
    mask = torch.rand(n, S) < 0.5
    mask[0] = True
    loss, count = GNNNodeClassifier._masked_loss(out, y, mask[:, 0], "train_mask")
    assert count == int(mask[:, 0].sum()) and torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"train_mask has shape \[12, 3\].*FullGraphDataModule\(split=k\)"):
        GNNNodeClassifier._masked_loss(out, y, mask, "train_mask")
    with pytest.raises(ValueError, match="index_to_mask"):
        GNNNodeClassifier._masked_loss(out, y, torch.tensor([0, 3]), "val_mask")
    with pytest.raises(ValueError, match=r"shape \[11\] but the batch has 12 nodes"):
        GNNNodeClassifier._masked_loss(out, y, mask[1:, 0])

    model = GNNNodeClassifier(in_channels=4, num_classes=c, hidden_channels=8)
    batch = Data(x=torch.randn(n, 4), y=y, edge_index=torch.tensor([[0, 1], [1, 2]]), num_nodes=n,
                 train_mask=mask, val_mask=mask, test_mask=mask)
    for step in (model.training_step, model.validation_step, model.test_step):
        with pytest.raises(ValueError, match="multi-split"):
            step(batch, 0)

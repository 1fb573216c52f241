"""``dm.prepare_data(); dm.setup()`` called by the user before ``trainer.fit`` (to read
``dm.num_features`` / ``dm.num_classes``) must not pin the partition that a setup without a
trainer loads: the trainer's ranks decide which part each of them trains (issue 29, item 5).

Real ranks: the trainer forks its gloo ranks (``cpu_trainer``), which inherit the datamodule
the user set up in this process, exactly as in the reported run."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.partition.cache import PartitionCacheError
from tests.helpers import NodeClassifier, cpu_trainer, directed_graph, reference_training

STEPS = 3


def _fit(model: NodeClassifier, dm: FullGraphDataModule, world_size: int) -> dict[str, torch.Tensor]:
    cpu_trainer(world_size, max_epochs=STEPS).fit(model, datamodule=dm)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_parts", [None, 2])
def test_fit_after_a_setup_without_trainer_trains_the_trainers_parts(tmp_path, num_parts) -> None:
    """A 2-rank fit after a pre-fit ``dm.prepare_data(); dm.setup()`` succeeds and ends with the
    same weights as the same fit without it (and as single-process training).

    Negative control: the former early return of ``setup`` (``if self.local_partition is not
    None: return``, whatever the trainer) -> the fit fails with "rank 0 of 2 got part 0 of 1;
    partition the graph into as many parts as ranks" (``num_parts=None``), and the pre-fit
    ``setup()`` itself fails with "holds 2 parts but 1 rank(s) run" (``num_parts=2``)."""
    data = directed_graph(seed=7)
    torch.manual_seed(0)
    model = NodeClassifier(conv="gcn", num_layers=2)
    initial = copy.deepcopy(model.state_dict())
    expected = reference_training(copy.deepcopy(model), data, STEPS)
    assert any(not torch.equal(initial[k], expected[k]) for k in expected), "training must move the weights"

    plain = _fit(copy.deepcopy(model), FullGraphDataModule(data, num_parts=num_parts, cache_dir=tmp_path), 2)

    dm = FullGraphDataModule(data, num_parts=num_parts, cache_dir=tmp_path)
    dm.prepare_data()
    dm.setup()
    assert (dm.num_features, dm.num_classes) == (8, 3)
    after_setup = _fit(copy.deepcopy(model), dm, 2)

    assert after_setup.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(after_setup[key], plain[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(after_setup[key], expected[key], msg=key)
    # The user's datamodule is still usable afterwards, as set up in this process.
    assert (dm.num_features, dm.num_classes) == (8, 3)


def test_setup_without_trainer_tells_what_it_loaded(tmp_path) -> None:
    """Without a trainer, ``setup()`` makes the partition folder (its manifest answers
    ``num_features``/``num_classes``); it loads a part only where one process trains the graph
    (one part).  With ``num_parts=2`` there is no rank to load a part for: the dataloaders say
    so and what to do instead of serving half the graph.

    Negative control: the former ``setup`` raises "holds 2 parts but 1 rank(s) run" in the
    ``num_parts=2`` ``setup()`` call."""
    data = directed_graph(seed=8)
    one = FullGraphDataModule(data, cache_dir=tmp_path)
    one.setup()
    assert one.local_partition is not None and one.local_partition.plan.world_size == 1
    assert next(iter(one.train_dataloader())).num_nodes == data.num_nodes

    two = FullGraphDataModule(data, num_parts=2, cache_dir=tmp_path)
    two.setup()
    assert two.local_partition is None
    assert (two.num_features, two.num_classes) == (8, 3) and two.manifest["num_parts"] == 2
    with pytest.raises(RuntimeError, match=r"num_parts=2.*without a trainer.*Trainer\(devices=2"):
        two.train_dataloader()


def test_a_given_partition_folder_of_the_wrong_size_names_both_sizes(tmp_path) -> None:
    """What cannot work says what happened and what to do: a partition folder of 1 part given as
    ``data`` to a 2-rank run (the launcher's check, before any rank starts).  Negative control:
    the former message ("cannot use partition folder ...: num_parts is 1 in ..., expected 2")
    said nothing of what to do -> the ``match`` fails."""
    folder = FullGraphDataModule(directed_graph(seed=9), cache_dir=tmp_path)
    folder.prepare_data()
    assert folder.partition_result is not None
    dm = FullGraphDataModule(str(folder.partition_result.folder))
    dm.setup()  # without a trainer: one part, one process
    with pytest.raises(
        PartitionCacheError, match=r"num_parts is 1 .* expected 2.*lightning-fullgraph partition"
    ):
        cpu_trainer(2, max_epochs=1).fit(NodeClassifier(), datamodule=dm)

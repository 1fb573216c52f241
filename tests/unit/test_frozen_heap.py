"""The collector's heap is frozen for the span of a fit (``lightning_fullgraph._os.FrozenHeap``)."""

from __future__ import annotations

import gc

import lightning.pytorch as pl

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph._os import FrozenHeap
from lightning_fullgraph.models import GNNNodeClassifier


def _in_generation_2(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects(generation=2))


def test_install_freezes_what_exists_and_remove_gives_it_back() -> None:
    """Between ``install`` and ``remove`` an object that existed before is in no generation a
    collection walks; afterwards it is in the oldest one again and nothing stays frozen.
    Both calls are idempotent.  Negative controls: ``install`` without ``gc.freeze()`` leaves
    the object in a generation (the first check fails); ``remove`` without
    ``gc.unfreeze()`` leaves the freeze count above 0."""
    assert gc.get_freeze_count() == 0
    old = {"self": None}
    old["self"] = old  # a container the collector tracks
    gc.collect()  # into the oldest generation
    assert _in_generation_2(old)
    heap = FrozenHeap()
    try:
        heap.install()
        heap.install()
        assert heap.installed
        assert not _in_generation_2(old)
        assert gc.get_freeze_count() > 0
    finally:
        heap.remove()
        heap.remove()
    assert not heap.installed
    assert gc.get_freeze_count() == 0
    assert _in_generation_2(old)


def test_a_heap_someone_else_froze_is_left_alone() -> None:
    """When the heap is already frozen, ``install`` and ``remove`` change nothing: the freeze
    is not ours to undo.  Negative control: without the ``get_freeze_count() == 0`` check,
    ``remove`` unfreezes the caller's objects and they are back in generation 2."""
    old = {"self": None}
    old["self"] = old
    gc.freeze()
    try:
        heap = FrozenHeap()
        heap.install()
        assert not heap.installed
        heap.remove()
        # the caller's objects stay frozen (the count itself moves as frozen objects die)
        assert gc.get_freeze_count() > 0
        assert not _in_generation_2(old)
    finally:
        gc.unfreeze()


def test_a_fit_trains_with_the_heap_frozen_and_leaves_it_as_it_was() -> None:
    """Through the strategy: during training an object created before ``fit`` is frozen (a
    full collection does not walk it), and after ``fit`` the heap is as before (nothing
    frozen).  Negative controls: without ``self._frozen_heap.install()`` in
    ``FullGraphStrategy.setup`` the object is in generation 2 during training; without
    ``self._frozen_heap.remove()`` in ``teardown`` the freeze count stays above 0 after fit."""
    before = {"self": None}
    before["self"] = before
    seen: list[tuple[bool, int]] = []

    class Probe(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.append((_in_generation_2(before), gc.get_freeze_count()))

    pl.seed_everything(0)
    dm = FullGraphDataModule("community", dataset_kwargs={"num_nodes": 300, "num_val": 100, "num_test": 100})
    model = GNNNodeClassifier(conv="gcn", hidden_channels=8)
    trainer = pl.Trainer(
        strategy="fullgraph_exact", accelerator="cpu", devices=1, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Probe()],
    )
    gc.collect()
    assert _in_generation_2(before)
    trainer.fit(model, datamodule=dm)
    assert len(seen) == 2
    assert all(not in_gen2 and count > 0 for in_gen2, count in seen), seen
    assert gc.get_freeze_count() == 0
    assert _in_generation_2(before)

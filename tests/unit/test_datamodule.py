"""The datamodule's own rules about its arguments (:mod:`lightning_fullgraph.data.datamodule`).

``num_parts`` against the world size, with and without a trainer."""

from __future__ import annotations

import pytest

from lightning_fullgraph import FullGraphDataModule
from lightning_fullgraph.data.datamodule import check_num_parts
from tests.helpers import directed_graph


# -- num_parts against the world size -------------------------------------------------------
def test_num_parts_must_equal_the_world_size() -> None:
    """Negative control: ``check_num_parts`` returning ``num_parts`` unchecked fails the
    ``raises``."""
    assert check_num_parts(None, 3) == 3
    assert check_num_parts(3, 3) == 3
    with pytest.raises(ValueError, match=r"num_parts=2\) but the trainer runs 3 rank\(s\)") as err:
        check_num_parts(2, 3)
    assert "set num_parts=None (or 3), or run with 2 devices" in str(err.value)


def test_the_datamodule_counts_parts_against_a_given_world_size(tmp_path) -> None:
    """``expected_parts`` with no trainer and no world size checks nothing (as before); with
    a world size it checks.  Negative control: ignoring ``world_size`` fails the ``raises``."""
    dm = FullGraphDataModule(directed_graph(), num_parts=2, cache_dir=tmp_path)
    assert dm.expected_parts() == 2
    assert dm.expected_parts(2) == 2
    with pytest.raises(ValueError, match="run with 2 devices"):
        dm.expected_parts(3)

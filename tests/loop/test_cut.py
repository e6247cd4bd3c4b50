"""Several processes, a device gone (loop._carry.Cut): each batch keeps its rows per
device, the chunks of the devices that left are cut out and listed, never carried."""

import numpy as np

from jaxstep.loop._carry import Cut
from jaxstep.loop._pending import Item


def _batch(rows):
    return {"x": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2), "y": np.arange(rows)}


def test_the_chunks_of_devices_that_left_are_cut_and_listed_by_batch_and_row():
    cut = Cut([2048, 2049, 2050, 2051], start=10)
    whole = Item(_batch(16), seq=0)
    assert cut.take(whole).item is whole  # no device gone yet: the batch as it came
    cut.exclude([2049])
    taken, listed = cut.take(Item(_batch(16), seq=1))
    assert taken.batch["y"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    assert (taken.first, taken.offset, taken.chunks) == (1, 0, (0, 2, 3))
    assert listed == ((11, 4, 8),)  # the data's batch 11, rows 4..7 as passed
    # queued again (a recovery) after another device left: only what left since is cut
    cut.exclude([2051])
    again, listed = cut.take(taken)
    assert again.batch["y"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert again.chunks == (0, 2)
    assert listed == ((11, 12, 16),) and cut.listed == [(11, 4, 8), (11, 12, 16)]
    assert cut.cut == 8 and cut.left() == [] and cut.release() == []


def test_presplit_batches_are_joined_when_cut():
    cut = Cut([0, 1], start=0, presplit=True)
    cut.exclude([0])
    split = {"x": np.arange(8, dtype=np.float32).reshape(2, 2, 2), "y": np.arange(4).reshape(2, 2)}
    taken, listed = cut.take(Item(split, seq=3))
    assert taken.batch["y"].tolist() == [2, 3] and taken.batch["x"].shape == (2, 2)
    assert listed == ((3, 0, 2),)

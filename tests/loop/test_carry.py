"""One process, a device gone (loop._carry.Carry): each step trains the largest
multiple of the devices of the rows at hand and carries the rest, knowing where each
row came from."""

import numpy as np

from jaxstep.loop._carry import Carry
from jaxstep.loop._pending import Item


def test_presplit_batches_laid_out_for_the_devices_before_are_joined_and_carried():
    carry = Carry(unit=3, presplit=True)  # 4 devices before, 3 left
    split = {"x": np.arange(16, dtype=np.float32).reshape(4, 2, 2), "y": np.arange(8).reshape(4, 2)}
    taken = carry.take(Item(split, seq=5))
    assert taken.batch["y"].tolist() == [0, 1, 2, 3, 4, 5] and taken.batch["x"].shape == (6, 2)
    assert (taken.first, taken.offset, taken.spans) == (5, 0, ((5, 0, 6),))
    rows, spans = carry.rows, carry.spans
    assert rows["y"].tolist() == [6, 7] and spans == [(5, 6, 8)]

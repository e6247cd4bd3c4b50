"""One process, a device gone (loop._carry.Carry): each step trains the largest
multiple of the devices of the rows at hand and carries the rest, knowing where each
row came from; rows of different shapes (bucketed lengths) are never joined: each
waits for a batch of its own shape (tests/loop/test_carry_shapes.py runs it in fit)."""

import itertools

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.checkpoint import Cursor
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._pending import Item
from jaxstep.testing import Fault
from tests.models import bucketed_batches
from tests.models import fit_recording
from tests.models import init_params
from tests.models import seq_loss_fn


def test_presplit_batches_laid_out_for_the_devices_before_are_joined_and_carried():
    carry = Carry(unit=3, presplit=True)  # 4 devices before, 3 left
    split = {"x": np.arange(16, dtype=np.float32).reshape(4, 2, 2), "y": np.arange(8).reshape(4, 2)}
    taken = carry.take(Item(split, seq=5))
    assert taken.batch["y"].tolist() == [0, 1, 2, 3, 4, 5] and taken.batch["x"].shape == (6, 2)
    assert (taken.first, taken.offset, taken.spans) == (5, 0, ((5, 0, 6),))
    ((rows, spans),) = carry.held.values()
    assert rows["y"].tolist() == [6, 7] and spans == [(5, 6, 8)]


def test_carried_rows_of_another_shape_wait_for_a_batch_of_their_own_shape():
    """Bucketed lengths: rows carried from a batch padded to 24 cannot join one padded
    to 16; they stay carried (not listed) until a batch padded to 24 comes, while the
    short rows are carried beside them."""
    carry = Carry(unit=3, start=10)
    long = {"x": np.zeros((4, 24), np.float32)}
    short = {"x": np.ones((4, 16), np.float32)}
    first = carry.take(Item(long, seq=0))
    assert first.batch["x"].shape == (3, 24) and carry.left() == [(0, 3, 4)]
    second = carry.take(Item(short, seq=1))
    assert second.batch["x"].shape == (3, 16) and (second.first, second.offset) == (1, 0)
    assert second.spans == ((1, 0, 3),)
    assert carry.left() == [(0, 3, 4), (1, 3, 4)]  # both shapes carried, in the data's order
    third = carry.take(Item({"x": np.full((5, 24), 2, np.float32)}, seq=2))  # 1 + 5
    assert third.spans == ((0, 3, 4), (2, 0, 5))
    assert third.batch["x"][:, 0].tolist() == [0, 2, 2, 2, 2, 2]
    assert carry.left() == [(1, 3, 4)]  # the short row still waits
    assert carry.take(Item({"x": np.ones((1, 16), np.float32)}, seq=3)) is None
    released = carry.release()  # one item a shape, by first row: what err.batches gets
    assert [(i.first, i.offset, i.spans) for i in released] == [(1, 3, ((1, 3, 4), (3, 0, 1)))]
    assert carry.left() == [] and carry.finish() == []


def test_the_rows_left_at_the_end_are_listed_per_shape_with_a_warning():
    carry = Carry(unit=3, start=10)
    carry.take(Item({"x": np.zeros((5, 24), np.float32)}, seq=0))  # 3 trained, 2 carried
    carry.take(Item({"x": np.zeros((4, 16), np.float32)}, seq=1))  # 3 trained, 1 carried
    with pytest.warns(UserWarning, match=r"3 row\(s\) carried") as caught:
        listed = carry.finish()
    assert listed == [(10, 3, 5), (11, 3, 4)] and carry.left() == []
    text = str(caught[0].message)
    assert "2 with ['x'] (24,) float32; 1 with ['x'] (16,) float32" in text, text


def test_a_resume_passes_over_the_rows_trained_between_the_untrained_ones():
    """A position saved while two shapes were carried: batch 0 from row 2, batch 1
    trained whole, batch 2 from row 3 (``then``), batch 3 on whole."""
    carry = Carry(unit=3, resumed=Cursor(0, 2, ((2, 3),)))
    rows = [{"x": np.arange(4, dtype=np.float32)[:, None] + 10 * b} for b in range(4)]
    assert carry.take(Item(rows[0], seq=0)) is None and carry.left() == [(0, 2, 4)]
    assert carry.take(Item(rows[1], seq=1)) is None  # trained before: passed over
    taken = carry.take(Item(rows[2], seq=2))
    assert taken.spans == ((0, 2, 4), (2, 3, 4)) and taken.batch["x"][:, 0].tolist() == [2, 3, 23]
    assert carry.take(Item(rows[3], seq=3)).spans == ((3, 0, 3),)


def test_a_take_that_raises_changes_nothing():
    carry = Carry(unit=3)
    carry.take(Item({"x": np.zeros((4, 2), np.float32)}, seq=0))
    with pytest.raises(ValueError):
        carry.take(Item({"x": np.zeros((0, 2), np.float32)}, seq=1))
    ((rows, spans),) = carry.held.values()
    assert spans == [(0, 3, 4)] and rows["x"].shape == (1, 2)


def test_a_device_gone_with_bucketed_lengths_trains_or_lists_every_row(backend):
    """Device 5 fails every step from step 0 and is excluded: 32-row batches padded to
    24, 16, 16, 24 tokens go on on 7 devices. Rows carried are joined only with rows
    of their own length (the 24-token rows of batch 0 wait for batch 3), and every row
    is trained or listed. The same step (7 devices left) trains a reference from the
    rows each step should take, and a run whose data source broke while rows of both
    lengths were carried, resumed as documented (fit(step, err.state, chain(err.batches,
    rest))): both end where the first run did."""
    devices = jax.devices()
    faults = [Fault("loss", devices[5].id, step=t, mode="device") for t in range(12)]
    data = bucketed_batches([24, 16, 16, 24])
    step = jaxstep.make_train_step(seq_loss_fn, optax.adam(1e-2), backend=backend, faults=faults)
    trained, history, caught = fit_recording(
        step, step.init(init_params()), data, recover=jaxstep.Recover()
    )
    assert [(r.step, r.action) for r in history.recoveries] == [(0, "excluded")]
    # batch 0: rows 0..27, 4 carried; batch 1 (shorter): 0..27, 4 carried beside them;
    # batch 2 (short): 4 + 31 rows, 1 carried; batch 3 (long): batch 0's 4 + 31, 1 left
    assert history.left_over == [(2, 31, 32), (3, 31, 32)]
    assert history.step == [0, 0, 1, 2, 3] and not any(s.any() for s in history.status[1:])
    assert any("2 row(s) carried" in w and "of each shape" in w for w in caught), caught
    trained = step.host_state(trained).params
    b = data
    steps = [
        {k: v[:28] for k, v in b[0].items()},
        {k: v[:28] for k, v in b[1].items()},
        {k: np.concatenate([b[1][k][28:], b[2][k][:31]]) for k in b[1]},
        {k: np.concatenate([b[0][k][28:], b[3][k][:31]]) for k in b[0]},
    ]
    reference = jaxstep.fit(step, step.init(init_params()), steps)  # each divides by 7
    chex.assert_trees_all_close(step.host_state(reference).params, trained, rtol=1e-6, atol=1e-7)

    def broken():  # the data source breaks while rows of both lengths are carried
        yield from data[:2]
        raise OSError("the data source broke")

    with pytest.raises(OSError) as info:
        fit_recording(step, step.init(init_params()), broken())
    err = info.value
    # nothing pulled is lost: each length's rows carried, as one batch each, in order
    assert [x["x"].shape for x in err.batches] == [(4, 24, 3), (4, 16, 3)]
    resumed, again, _ = fit_recording(step, err.state, itertools.chain(err.batches, data[2:]))
    assert again.left_over == [(2, 31, 32), (3, 31, 32)]  # err.batches' items are 0 and 1
    chex.assert_trees_all_equal(step.host_state(resumed).params, trained)

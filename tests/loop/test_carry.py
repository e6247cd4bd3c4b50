"""One process, a device gone (loop._carry.Carry): each step trains the largest
multiple of the devices of the rows at hand and carries the rest, knowing where each
row came from; rows of different shapes (bucketed lengths) are never joined."""

import itertools
import warnings

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep.loop._carry import Carry
from jaxstep.loop._pending import Item
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn


def test_presplit_batches_laid_out_for_the_devices_before_are_joined_and_carried():
    carry = Carry(unit=3, presplit=True)  # 4 devices before, 3 left
    split = {"x": np.arange(16, dtype=np.float32).reshape(4, 2, 2), "y": np.arange(8).reshape(4, 2)}
    taken = carry.take(Item(split, seq=5)).item
    assert taken.batch["y"].tolist() == [0, 1, 2, 3, 4, 5] and taken.batch["x"].shape == (6, 2)
    assert (taken.first, taken.offset, taken.spans) == (5, 0, ((5, 0, 6),))
    rows, spans = carry.rows, carry.spans
    assert rows["y"].tolist() == [6, 7] and spans == [(5, 6, 8)]


def test_carried_rows_of_another_shape_are_listed_never_joined():
    """Bucketed lengths: rows carried from a batch padded to 24 cannot join one padded
    to 16; fewer than a step needs, they are listed and the new batch starts afresh."""
    carry = Carry(unit=3, start=10)
    long = {"x": np.zeros((4, 24), np.float32)}
    short = {"x": np.ones((4, 16), np.float32)}
    first = carry.take(Item(long, seq=0))
    assert first.item.batch["x"].shape == (3, 24) and carry.spans == [(0, 3, 4)]
    assert first.left_over == ()
    second, listed = carry.take(Item(short, seq=1))
    assert second.batch["x"].shape == (3, 16) and (second.first, second.offset) == (1, 0)
    assert second.spans == ((1, 0, 3),) and carry.spans == [(1, 3, 4)]
    assert listed == ((10, 3, 4),)  # batch 0's last row, counted from the data's start
    third = carry.take(Item({"x": np.ones((5, 16), np.float32)}, seq=2)).item  # 1 + 5: joined
    assert third.spans == ((1, 3, 4), (2, 0, 5)) and carry.rows is None
    with pytest.warns(UserWarning, match="1 when the next batch had rows of another shape"):
        carry.finish()


def test_a_take_that_raises_changes_nothing():
    carry = Carry(unit=3)
    carry.take(Item({"x": np.zeros((4, 2), np.float32)}, seq=0))
    with pytest.raises(ValueError):
        carry.take(Item({"x": np.zeros((0, 2), np.float32)}, seq=1))
    assert carry.spans == [(0, 3, 4)] and carry.rows["x"].shape == (1, 2)


def _seq_loss(params, batch):
    """tests.models.loss_fn over the mean of a sequence axis (sst2-like, padded)."""
    return loss_fn(params, dict(batch, x=batch["x"].mean(axis=1)))


def _bucketed(lengths):
    rng = np.random.default_rng(1)
    out = []
    for length in lengths:
        x = rng.normal(size=(32, length, 3)).astype(np.float32)
        y = np.sin(x.mean(axis=1).sum(axis=1, keepdims=True)).astype(np.float32)
        ones, zeros = np.ones((32, 1), np.float32), np.zeros((32,), np.float32)
        out.append({"x": x, "y": y, "pos": ones, "poison": zeros})
    return out


def _fit(step, state, batches, **kw):
    history = jaxstep.History()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = jaxstep.fit(step, state, batches, history=history, **kw)
    return state, history, [str(w.message) for w in caught]


def test_a_device_gone_with_bucketed_lengths_trains_or_lists_every_row(backend):
    """Device 5 fails every step from step 0 and is excluded: 32-row batches padded to
    24, 16, 16, 24 tokens go on on 7 devices. Rows carried are joined only with rows
    of their own length, and every row is trained or listed. The same step (7 devices
    left) trains a reference from the rows each step should take, and a run whose data
    source broke while rows were carried, resumed as documented (fit(step, err.state,
    chain(err.batches, rest))): both end where the first run did."""
    devices = jax.devices()
    faults = [Fault("loss", devices[5].id, step=t, mode="device") for t in range(12)]
    data = _bucketed([24, 16, 16, 24])
    step = jaxstep.make_train_step(_seq_loss, optax.adam(1e-2), backend=backend, faults=faults)
    trained, history, caught = _fit(step, step.init(init_params()), data, recover=jaxstep.Recover())
    assert [(r.step, r.action) for r in history.recoveries] == [(0, "excluded")]
    # batch 0: rows 0..27, 4 carried; batch 1 is shorter: those 4 listed, 0..27, 4
    # carried; batch 2 (as short): 4 + 31 rows, 1 carried; batch 3 is longer: listed
    assert history.left_over == [(0, 28, 32), (2, 31, 32), (3, 28, 32)]
    assert history.step == [0, 0, 1, 2, 3] and not any(s.any() for s in history.status[1:])
    assert any("5 when the next batch had rows of another shape" in w for w in caught), caught
    trained = step.host_state(trained).params
    b = data
    steps = [
        {k: v[:28] for k, v in b[0].items()},
        {k: v[:28] for k, v in b[1].items()},
        {k: np.concatenate([b[1][k][28:], b[2][k][:31]]) for k in b[1]},
        {k: v[:28] for k, v in b[3].items()},
    ]
    reference = jaxstep.fit(step, step.init(init_params()), steps)  # each divides by 7
    chex.assert_trees_all_close(step.host_state(reference).params, trained, rtol=1e-6, atol=1e-7)

    def broken():  # the data source breaks while batch 1's last 4 rows are carried
        yield from data[:2]
        raise OSError("the data source broke")

    with pytest.raises(OSError) as info:
        _fit(step, step.init(init_params()), broken())
    err = info.value
    assert [x["x"].shape for x in err.batches] == [(4, 16, 3)]  # nothing pulled is lost
    resumed, again, _ = _fit(step, err.state, itertools.chain(err.batches, data[2:]))
    assert again.left_over == [(1, 31, 32), (2, 28, 32)]  # err.batches' item is batch 0
    chex.assert_trees_all_equal(step.host_state(resumed).params, trained)

"""Rows re-split over the devices on several processes (loop._resplit): the route
a batch's rows travel, checked against a hand-made gather for layouts of several
processes (the 2-process runs are in tests/distributed/test_recover_multihost.py), and
the real exchange and carry on one process's fake devices."""

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.loop._carry import Carry
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._resplit import Resplit
from jaxstep._src.loop._resplit import Route
from jaxstep._src.loop._resplit import exchange
from jaxstep._src.step import runtime_of
from tests.models import loss_fn


def gathered(origin, devices, per, route):
    """What the all-gather holds when each process places the rows it passed (its
    chunks of a global batch numbered 0..) on its devices, ``route.slot`` a device."""
    rows = np.arange(per * len(origin)).reshape(len(origin), per)
    slots = np.full((len(devices), route.slot), -1)
    for p in set(origin):
        passed = rows[[i for i, q in enumerate(origin) if q == p]].ravel()
        ks = [k for k, q in enumerate(devices) if q == p]
        padded = np.full(route.slot * len(ks), -1)
        padded[: len(passed)] = passed
        slots[ks] = padded.reshape(len(ks), route.slot)
    return slots.ravel()


@pytest.mark.parametrize(
    ("origin", "devices", "per", "slot"),
    [
        ([0] * 4 + [1] * 4, [0] * 4 + [1] * 3, 4, 6),  # process 1 lost a device: 16 over 3
        ([0] * 4 + [1] * 4, [0] * 2 + [1] * 4, 5, 10),  # process 0 lost two
        ([0, 1, 0, 1, 2, 2], [0, 1, 1, 2, 2], 3, 6),  # interleaved, three processes
        ([0] * 4 + [1] * 4, [0] * 4 + [1] * 4, 4, 4),  # none lost (a resume)
    ],
)
def test_the_route_puts_every_row_back_in_the_data_order(origin, devices, per, slot):
    route = Route.of(origin, devices, per)
    assert route.slot == slot
    held = gathered(origin, devices, per, route)
    assert held[route.order].tolist() == list(range(per * len(origin)))
    assert route.owner.tolist() == np.repeat(origin, per).tolist()


def test_the_exchange_on_one_process_gives_the_rows_back_unchanged():
    """Bit for bit and dtype for dtype: 64-bit ids (a device would make them 32-bit),
    float64, bools, a leaf with no values."""
    devices = jax.devices()
    rows = {
        "x": np.arange(64, dtype=np.float32).reshape(32, 2),
        "id": np.arange(32, dtype=np.int64) + 2**40,
        "w": np.linspace(0, 1, 32 * 3).reshape(32, 3, 1),
        "mask": np.arange(32) % 3 == 0,
        "none": np.zeros((32, 0), np.int16),
    }
    whole, owner = exchange(rows, 4, devices, devices[:7])  # through 7 devices, 5 rows each
    for key, x in rows.items():
        assert whole[key].dtype == x.dtype and whole[key].shape == x.shape, key
        np.testing.assert_array_equal(whole[key], x, err_msg=key)
    assert owner.tolist() == [0] * 32


def test_a_resplit_takes_the_rows_a_carry_takes_and_hands_back_its_own():
    seven = runtime_of(jaxstep.make_train_step(loss_fn, optax.sgd(0.1), devices=jax.devices()[:7]))
    resplit = Resplit(jax.devices(), seven, start=0, presplit=True)
    carry = Carry(7, presplit=True)
    for seq in range(3):
        batch = {"x": np.arange(32, dtype=np.float32).reshape(8, 4) + 100 * seq}
        want, got = carry.take(Item(batch, seq)), resplit.take(Item(batch, seq))
        np.testing.assert_array_equal(got.batch["x"], want.batch["x"])
        np.testing.assert_array_equal(got.shared.rows["x"], want.batch["x"])
        assert (got.spans, got.first, got.offset) == (want.spans, want.first, want.offset)
    assert resplit.left() == carry.left() == [(2, 27, 32)]
    (held,) = resplit.release()
    np.testing.assert_array_equal(held.batch["x"], np.arange(227, 232, dtype=np.float32))
    assert held.spans == ((2, 27, 32),)


@pytest.mark.parametrize("presplit", [False, True])
def test_batches_read_whole_are_cut_and_resplit_without_an_exchange(monkeypatch, presplit):
    """``fit(global_batches=True)``: each item holds the whole batch beside this process's
    rows (all of them on one process), the re-split takes the same rows as from gathered
    ones without a collective, and what is handed back is every row, as given."""
    from jaxstep._src.loop import _resplit
    from jaxstep._src.loop._resplit import Whole

    def no_exchange(*args, **kwargs):
        raise AssertionError("batches read whole must not travel through the devices")

    seven = runtime_of(jaxstep.make_train_step(loss_fn, optax.sgd(0.1), devices=jax.devices()[:7]))
    gathered_ = Resplit(jax.devices(), seven, start=0, presplit=presplit)
    wanted = []
    batches = [{"x": np.arange(32, dtype=np.float32) + 100 * seq} for seq in range(3)]
    if presplit:  # (n_devices, per_device)
        batches = [{"x": b["x"].reshape(8, 4)} for b in batches]
    for seq, batch in enumerate(batches):
        wanted.append(gathered_.take(Item(batch, seq)))
    monkeypatch.setattr(_resplit, "exchange", no_exchange)
    whole = Whole(jax.devices(), presplit)
    read = Resplit(jax.devices(), seven, start=0, presplit=presplit, everyone=True)
    for seq, batch in enumerate(batches):
        item = whole.item(batch, seq)
        np.testing.assert_array_equal(item.batch["x"], batch["x"])  # one process: every row
        assert item.shared.everyone and item.shared.owner.tolist() == [0] * 32
        assert item.shared.given() is batch  # handed back as given (pre-split: so)
        got = read.take(item)
        want = wanted[seq]
        np.testing.assert_array_equal(got.batch["x"], want.batch["x"])
        np.testing.assert_array_equal(got.shared.rows["x"], want.shared.rows["x"])
        assert (got.spans, got.first, got.offset) == (want.spans, want.first, want.offset)
        assert got.shared.everyone
    assert read.left() == gathered_.left() == [(2, 27, 32)]
    (held,) = read.release()
    np.testing.assert_array_equal(held.shared.given()["x"], np.arange(227, 232, dtype=np.float32))
    wrong = "n_devices=8" if presplit else "12 does not divide by the 8 .*global_batches=True"
    with pytest.raises(ValueError, match=wrong):
        whole.item({"x": np.zeros((7, 4) if presplit else (12, 4), np.float32)}, 3)


def test_global_batches_is_checked_and_changes_nothing_on_one_process():
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
    from tests.models import init_params
    from tests.models import make_batches

    batches = make_batches(3)
    with pytest.raises(TypeError, match=r"global_batches must be True .* got 'yes'"):
        jaxstep.fit(step, step.init(init_params()), batches, global_batches="yes")
    plain = jaxstep.fit(step, step.init(init_params()), batches)
    marked = jaxstep.fit(step, step.init(init_params()), batches, global_batches=True)
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(marked.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

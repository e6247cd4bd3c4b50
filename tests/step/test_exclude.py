"""Training on without some devices (``step.exclude_devices``), in place, as a step
built on the others would; and one step rerun as under ``on_failure="drop"``
(``Runtime.rerun_dropping``), whatever the step's own policy."""

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import PER_DEVICE
from tests.models import N
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of

GONE = 3  # the id of the device left out


def _step(backend, devices=None, **kw):
    # no replica check: one program fewer to compile per step (the tests stay fast)
    kw.setdefault("divergence_every", None)
    return jaxstep.make_train_step(
        loss_fn, optax.adam(1e-2), backend=backend, devices=devices, **kw
    )


def _rows(batch, n):
    """The first ``n * PER_DEVICE`` rows of ``batch``: PER_DEVICE rows for each of n devices."""
    return {k: v[: n * PER_DEVICE] for k, v in batch.items()}


def _without(devices, device_id=GONE):
    return [d for d in devices if d.id != device_id]


def _local(step, state):
    """One replica of ``state`` as numpy (a copy: the state may be donated later)."""
    return jax.tree.map(np.array, runtime_of(step).read_at(state, 0))


_errors_steps: dict = {}  # backend -> a step the error tests share (they change nothing)


@pytest.mark.parametrize("permuted", [False, True])
def test_a_step_without_a_device_trains_as_one_built_on_the_others(backend, permuted):
    devices = jax.devices()[::-1] if permuted else jax.devices()
    step = _step(backend, devices)
    batches = make_batches(5)
    state = step.init(init_params())
    for batch in batches[:2]:
        state, _ = step(state, batch)
    before = _local(step, state)
    state = step.exclude_devices([GONE], state)
    remaining = _without(devices)
    assert step.devices == remaining and step.options.devices == tuple(remaining)
    assert [d.id for d in step.devices] == list(step.options.device_ids)
    assert GONE not in step.options.device_ids and len(step.devices) == N - 1
    step.check_state(state)  # it fits the step as it is now
    assert runtime_of(step).replicas_agree(state)
    reference = _step(backend, remaining)
    expected = reference.place_state(before)
    for batch in batches[2:]:
        batch = _rows(batch, N - 1)
        state, out = step(state, batch)
        expected, _ = reference(expected, batch)
        table = step.table(out)
        assert table.status.tolist() == [0] * (N - 1) and not step.failures(table)
    chex.assert_trees_all_equal(host_params(step, state), host_params(reference, expected))
    assert int(runtime_of(step).read_first(state.step)) == 5
    # the other methods run on the smaller step too
    out = runtime_of(step).replay(state, _rows(batches[0], N - 1), rotation=2)
    assert step.table(out).status.tolist() == [0] * (N - 1)
    assert not bool(np.asarray(step.clear_halt(state).halted).any())
    if not permuted:
        compiled = step.compile(state, _rows(batches[0], N - 1))
        assert compiled.memory_analysis() is not None
        with pytest.raises(ValueError, match=f"does not divide by the {N - 1} devices"):
            step(state, batches[0])  # a batch for eight devices


def test_the_loss_spike_window_keeps_the_remaining_devices_columns(backend):
    spike = jaxstep.LossSpike(window=4, warmup=2, sigmas=50.0)
    step = _step(backend, loss_spike=spike)
    state = step.init(init_params())
    for batch in make_batches(3):
        state, _ = step(state, batch)
    window = runtime_of(step).read_at(state, 0).monitor["spike"]
    assert window["losses"].shape == (4, N) and int(window["count"]) == 3
    state = step.exclude_devices([GONE], state)
    now = runtime_of(step).read_at(state, 0).monitor["spike"]
    keep = [i for i, d in enumerate(jax.devices()) if d.id != GONE]
    np.testing.assert_array_equal(now["losses"], window["losses"][:, keep])
    assert int(now["count"]) == 3
    state, out = step(state, _rows(make_batches(1, seed=9)[0], N - 1))
    assert step.table(out).status.tolist() == [0] * (N - 1)
    assert runtime_of(step).read_at(state, 0).monitor["spike"]["losses"].shape == (4, N - 1)


def test_the_drop_policys_counts_keep_the_remaining_devices(backend):
    devices = jax.devices()
    five = devices[5].id
    step = _step(backend, on_failure="drop", max_dropped=N - 1, faults=Fault("input", five, step=1))
    state = step.init(init_params())
    for batch in make_batches(2):
        state, _ = step(state, batch)
    host = runtime_of(step).read_at(state, 0)
    assert host.monitor["drops"].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    state = step.exclude_devices([GONE], state)
    assert step.options.max_dropped == N - 2  # lowered to what the new count allows
    now = runtime_of(step).read_at(state, 0)
    keep = [i for i, d in enumerate(devices) if d.id != GONE]
    assert now.monitor["drops"].tolist() == host.monitor["drops"][keep].tolist()
    assert now.monitor["repairs"].tolist() == [0] * (N - 1)
    assert int(now.total_drops) == 1
    state, out = step(state, _rows(make_batches(1, seed=9)[0], N - 1))
    assert not step.table(out).dropped.any()


def test_faults_keep_their_devices_after_another_one_goes(backend):
    devices = jax.devices()
    six, five = devices[6].id, devices[5].id
    faults = [
        Fault("loss", six, step=1, mode="transient"),
        Fault("input", GONE, step=3),  # never fires: its device goes first
        Fault("input", five, step=4),
    ]
    step = _step(backend, on_failure="skip", faults=faults)
    batches = [_rows(b, N - 1) for b in make_batches(5)]
    state, _ = step(step.init(init_params()), make_batches(1)[0])
    at_1 = _local(step, state)
    state, out = step(state, make_batches(2)[1])
    assert step.table(out).status[6] & Status.LOSS_NONFINITE  # the transient fired
    state = step.exclude_devices([GONE], state)
    assert step.options.max_dropped is None and step.options.dropped_limit == (N - 2) // 2
    # the transient that fired does not fire again, from the state before it
    _, out = step(step.place_state(at_1), batches[1])
    assert step.table(out).status.tolist() == [0] * (N - 1)
    state, out = step(state, batches[2])
    state, out = step(state, batches[3])  # step 3: the fault of the device gone
    assert step.table(out).status.tolist() == [0] * (N - 1)
    at_4 = _local(step, state)
    state, out = step(state, batches[4])
    table = step.table(out)
    assert [f.device_id for f in step.failures(table)] == [five]
    assert table.status[step.devices.index(devices[5])] & Status.INPUT_NONFINITE
    # the dropping rerun is built for the devices now: device 5 is left out, alone
    _, out = runtime_of(step).rerun_dropping(step.place_state(at_4), batches[4])
    table = step.table(out)
    assert table.dropped.tolist() == [d.id == five for d in step.devices]
    assert not table.skipped


def test_excluding_an_unknown_device_or_every_device_is_refused(backend):
    step = _errors_steps.get(backend) or _errors_steps.setdefault(backend, _step(backend))
    state = step.init(init_params())
    with pytest.raises(ValueError, match="device 99 is not one of this step's devices"):
        step.exclude_devices([99], state)
    with pytest.raises(ValueError, match="leaves this step no device"):
        step.exclude_devices([d.id for d in jax.devices()], state)
    with pytest.raises(TypeError, match=r"sequence of jax\.Device\.id ints"):
        step.exclude_devices(GONE, state)  # type: ignore[arg-type]
    assert len(step.devices) == N  # nothing changed
    step.check_state(state)


def _oracle(params, opt_state, batch, healthy, optimizer):
    """One optax update with the mean over the ``healthy`` positions of each chunk's
    gradient, on the host (as tests/program/test_drop.py computes it)."""
    chunk = lambda i: {k: v[rows_of(i)] for k, v in batch.items()}  # noqa: E731
    grads = [jax.grad(loss_fn)(params, chunk(i)) for i in healthy]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@pytest.mark.parametrize("policy", ["raise", "drop"])
def test_a_rerun_dropping_leaves_the_failing_chunk_out_of_the_mean(backend, policy):
    bad = jax.devices()[GONE].id
    step = _step(backend, on_failure=policy, faults=Fault("input", bad, step=1, mode="data"))
    batches = make_batches(3)
    state, _ = step(step.init(init_params()), batches[0])
    before = _local(step, state)
    halted, out = step(state, batches[1])  # the fault fires
    assert step.table(out).status[GONE] & Status.INPUT_NONFINITE
    start = step.place_state(before) if policy == "drop" else halted
    state, out = runtime_of(step).rerun_dropping(start, batches[1])
    table = step.table(out)
    assert table.dropped.tolist() == [i == GONE for i in range(N)]
    assert not table.skipped and not table.halted
    assert [f.device_id for f in step.failures(table)] == [bad]
    healthy = [i for i in range(N) if i != GONE]
    params, _ = _oracle(before.params, before.opt_state, batches[1], healthy, optax.adam(1e-2))
    chex.assert_trees_all_close(host_params(step, state), params, rtol=2e-5, atol=1e-6)
    host = runtime_of(step).read_at(state, 0)
    assert int(host.step) == 2
    if policy == "drop":  # its own fields, carried on
        assert int(host.total_drops) == 1 and host.monitor["drops"][GONE] == 1
    else:  # the raise policy's structure
        assert host.total_drops is None and "drops" not in host.monitor
        assert bool(np.asarray(start.halted).all())  # cleared in the rerun only
    step.check_state(start)  # not donated
    state, out = step(state, batches[2])  # and the step goes on from it
    assert step.table(out).status.tolist() == [0] * N
    assert int(runtime_of(step).read_first(state.step)) == 3


def test_without_devices_makes_a_new_step_and_leaves_the_old_one_valid(backend):
    """``step.without_devices(ids, state)``: a new step on the devices left, the state on
    them; the step it was called on still runs on its own devices from ``state``."""
    step = _step(backend)
    batches = make_batches(3)
    state, _ = step(step.init(init_params()), batches[0])
    before = _local(step, state)
    smaller, moved = step.without_devices([GONE], state)
    assert smaller is not step and smaller.devices == _without(jax.devices())
    assert len(step.devices) == N and runtime_of(step) is not runtime_of(smaller)
    reference = _step(backend, _without(jax.devices()))
    expected, _ = reference(reference.place_state(before), _rows(batches[1], N - 1))
    moved, out = smaller(moved, _rows(batches[1], N - 1))
    assert smaller.table(out).status.tolist() == [0] * (N - 1)
    chex.assert_trees_all_equal(host_params(smaller, moved), host_params(reference, expected))
    step.check_state(state)  # not donated, and still the old step's
    state, out = step(state, batches[1])  # the old step, on all N devices, from its state
    assert step.table(out).status.tolist() == [0] * N
    assert int(runtime_of(step).read_first(state.step)) == 2

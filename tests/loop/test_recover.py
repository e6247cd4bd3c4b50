"""fit(..., recover=jaxstep.Recover()): each verdict acted on, recorded, and nothing
lost: every batch either trained or listed in a record."""

import json
import warnings

import chex
import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep import Status
from jaxstep._src.step import Runtime
from jaxstep.testing import Fault
from jaxstep.testing import corrupt_replica
from tests.models import PER_DEVICE
from tests.models import HostFault
from tests.models import host_params
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def _step(backend, loss=loss_fn, **kw):
    return jaxstep.make_train_step(loss, optax.adam(1e-2), backend=backend, **kw)


def _clean(backend, batches, **kw):
    step = _step(backend, **kw)
    return host_params(step, jaxstep.fit(step, step.init(init_params()), batches))


def test_a_transient_fault_is_retried_and_leaves_no_trace(backend):
    dev = jax.devices()[3]
    batches = make_batches(6)
    step = _step(backend, faults=[Fault("input", dev.id, step=2, mode="transient")])
    history = jaxstep.History()
    state = jaxstep.fit(
        step, step.init(init_params()), batches, recover=jaxstep.Recover(), history=history
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "transient", "retried")
    assert (record.device_ids, record.batch, record.skipped_batches) == ((dev.id,), 2, ())
    assert history.step == [0, 1, 2, 2, 3, 4, 5]  # step 2 failed, then ran again
    assert history.status[2][3] == Status.INPUT_NONFINITE and not history.status[3].any()
    assert int(step.host_state(state).step) == 6
    chex.assert_trees_all_equal(host_params(step, state), _clean(backend, batches))


def test_retries_run_out_then_the_failure_raises_with_the_recoveries_listed(backend):
    dev = jax.devices()[5]
    batches = make_batches(5)
    # a device fault is a "device" verdict: with exclude_devices off nothing recovers it
    step = _step(
        backend,
        faults=[
            Fault("input", dev.id, step=1, mode="transient"),
            Fault("loss", dev.id, step=3, mode="device"),
        ],
    )
    recover = jaxstep.Recover(exclude_devices=False)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(step, step.init(init_params()), batches, recover=recover)
    err = info.value
    assert (err.device_id, err.step) == (dev.id, 3) and Status.LOSS_NONFINITE in err.status
    assert [f.device_id for f in err.failures] == [dev.id]
    assert err.diagnosis.verdict == "device"
    assert "Recover(exclude_devices=False)" in str(err)
    assert "fit recovered 1 failure(s) before this one" in str(err)
    assert "step 1: transient -> retried" in str(err)
    # nothing lost: the failing batch and the one after it come back untrained
    assert [b is x for b, x in zip(err.batches, batches[3:], strict=True)] == [True, True]
    assert int(step.host_state(err.state).step) == 3


def test_a_budget_of_one_with_two_faults_raises_naming_the_budget(backend):
    dev = jax.devices()[2]
    step = _step(
        backend,
        faults=[
            Fault("input", dev.id, step=1, mode="transient"),
            Fault("input", dev.id, step=3, mode="transient"),
        ],
    )
    history = jaxstep.History()
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(5),
            recover=jaxstep.Recover(max_recoveries=1),
            history=history,
        )
    err = info.value
    assert err.step == 3 and err.device_id == dev.id
    assert "max_recoveries=1" in str(err)
    assert [r.action for r in history.recoveries] == ["retried"]


def _spiky_batches(n, spike_at):
    batches = make_batches(n)
    batches[spike_at] = dict(batches[spike_at], y=batches[spike_at]["y"] * 1e3)
    return batches


def test_a_loss_spike_rolls_back_to_the_checkpoint_and_skips_its_batches(backend, tmp_path):
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    batches = _spiky_batches(10, spike_at=7)
    step = _step(backend, loss_spike=spike)
    history = jaxstep.History()
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        recover=jaxstep.Recover(rollback_batches=2),
        history=history,
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (7, "spike", "rolled back")
    assert record.skipped_batches == (6, 7) and record.batch == 7
    assert "checkpoint of step 4" in record.detail and "2 batch(es)" in record.detail
    # steps 0..7 ran, the spike at 7 sent it back to 4: batches 4, 5 again, then 8, 9
    assert history.step == [0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    assert history.loss[8:10] == history.loss[4:6]  # the same batches from the same state
    assert int(step.host_state(state).step) == 8
    kept = [b for i, b in enumerate(batches) if i not in (6, 7)]
    chex.assert_trees_all_equal(host_params(step, state), _clean(backend, kept, loss_spike=spike))


class _ArmOnRollback:
    """Arms a :class:`tests.models.HostFault` when a rollback is recorded."""

    def __init__(self, fault):
        self.fault = fault

    def on_recovery(self, record):
        if record.action == "rolled back":
            self.fault.arm()


def test_a_batch_trained_again_after_a_rollback_gets_its_retries_afresh(backend, tmp_path):
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    batches = _spiky_batches(10, spike_at=7)
    first, again = jax.devices()[2], jax.devices()[6]
    # batch 4 fails once (retried), the spike at 7 goes back to the checkpoint of step 4,
    # and batch 4 fails once more on another device: a fresh attempt, retried again
    late = HostFault(6)
    transient = Fault("input", first.id, step=4, mode="transient")
    step = _step(backend, loss=late.loss, loss_spike=spike, faults=[transient])
    history = jaxstep.History()
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        recover=jaxstep.Recover(retries=1, rollback_batches=2),
        history=history,
        callbacks=[_ArmOnRollback(late)],
        checkpoint_dir=tmp_path,
        checkpoint_every=4,
    )
    assert late.fired == 1
    records = [
        (r.step, r.verdict, r.action, r.device_ids, r.batch, r.skipped_batches)
        for r in history.recoveries
    ]
    assert records == [
        (4, "transient", "retried", (first.id,), 4, ()),
        (7, "spike", "rolled back", tuple(d.id for d in jax.devices()), 7, (6, 7)),
        (4, "transient", "retried", (again.id,), 4, ()),
    ]
    assert history.step == [0, 1, 2, 3, 4, 4, 5, 6, 7, 4, 4, 5, 6, 7]
    assert int(step.host_state(state).step) == 8
    kept = [b for i, b in enumerate(batches) if i not in (6, 7)]
    reference = _step(backend, loss=HostFault(6).loss, loss_spike=spike)
    chex.assert_trees_all_equal(
        host_params(step, state),
        host_params(reference, jaxstep.fit(reference, reference.init(init_params()), kept)),
    )


def test_a_spike_without_rollback_batches_raises(backend, tmp_path):
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    step = _step(backend, loss_spike=spike)
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            _spiky_batches(8, spike_at=5),
            recover=jaxstep.Recover(),
            checkpoint_dir=tmp_path,
            checkpoint_every=2,
        )
    assert info.value.status == Status.LOSS_SPIKE
    assert "Recover(rollback_batches=k)" in str(info.value)


@pytest.mark.parametrize("saved", [False, True])
def test_a_diverged_replica_is_rebuilt_from_the_majority_and_the_step_run_again(
    backend, tmp_path, saved
):
    """Corrupted between two fit calls. Without a checkpoint of the first call the
    rollback has no verified checkpoint to go back to, so the replica is repaired, even
    with rollback_batches set (docs/recovery.md's rule); with one, the first call saved
    its end (verified, before the corruption) and the run goes back to it."""
    devices = jax.devices()
    step = _step(backend, divergence_every=1)
    batches = make_batches(6)
    clean = _clean(backend, batches, divergence_every=1)
    checkpoints = {"checkpoint_dir": tmp_path, "checkpoint_every": 2}
    first = checkpoints if saved else {}
    state = jaxstep.fit(step, step.init(init_params()), batches[:3], **first)
    bad = devices[6]
    state = corrupt_replica(step, state, bad.id, "params['dense2']['kernel']", ulps=1)
    history = jaxstep.History()
    recover = jaxstep.Recover(rollback_batches=2)
    state = jaxstep.fit(step, state, batches[3:], history=history, recover=recover, **checkpoints)
    (record,) = history.recoveries
    action = "rolled back" if saved else "repaired"
    assert (record.step, record.verdict, record.action) == (3, "diverged", action)
    assert record.device_ids == (bad.id,)
    jaxstep.testing.assert_replicas_equal(step, state)
    chex.assert_trees_all_equal(host_params(step, state), clean)


def test_a_replica_diverged_inside_a_fit_call_is_rolled_back_and_its_batches_retried_afresh(
    backend, tmp_path, monkeypatch
):
    """A replica corrupted before step 5 (inside the fit call) is found at step 5 and
    rolled back to the verified checkpoint of step 4: batches 4 and 5 train again, and
    batch 4, retried once before, gets a fresh retry when it fails again (retries count
    per batch since a rollback last queued it). The device is kept."""
    devices = jax.devices()
    bad, first, again = devices[6], devices[2], devices[3]
    late = HostFault(3)
    transient = Fault("input", first.id, step=4, mode="transient")
    step = _step(backend, loss=late.loss, divergence_every=1, faults=[transient])
    dispatch, corrupted = Runtime.dispatch, []

    def corrupting(runtime, state, batch, **kw):  # once, before a good step 5 is dispatched
        number, halted = runtime.read_first((state.step, state.halted))
        if not corrupted and int(number) == 5 and not bool(halted):
            corrupted.append(5)
            state = corrupt_replica(step, state, bad.id, "params['dense2']['kernel']", ulps=1)
        return dispatch(runtime, state, batch, **kw)

    monkeypatch.setattr(Runtime, "dispatch", corrupting)
    batches = make_batches(7)
    history = jaxstep.History()
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        recover=jaxstep.Recover(retries=1, rollback_batches=2),
        history=history,
        callbacks=[_ArmOnRollback(late)],
        checkpoint_dir=tmp_path,
        checkpoint_every=2,
    )
    assert corrupted == [5] and late.fired == 1
    records = [(r.step, r.verdict, r.action, r.device_ids) for r in history.recoveries]
    assert records == [
        (4, "transient", "retried", (first.id,)),
        (5, "diverged", "rolled back", (bad.id,)),
        (4, "transient", "retried", (again.id,)),
    ]
    assert history.step == [0, 1, 2, 3, 4, 4, 5, 4, 4, 5, 6]
    assert [d.id for d in step.devices] == [d.id for d in devices]  # the device is kept
    jaxstep.testing.assert_replicas_equal(step, state)
    reference = _step(backend, loss=HostFault(3).loss, divergence_every=1)
    chex.assert_trees_all_equal(
        host_params(step, state),
        host_params(reference, jaxstep.fit(reference, reference.init(init_params()), batches)),
    )


def test_recover_is_checked():
    with pytest.raises(ValueError, match="retries"):
        jaxstep.Recover(retries=-1)
    with pytest.raises(ValueError, match="rollback_batches"):
        jaxstep.Recover(rollback_batches=0)
    with pytest.raises(TypeError, match="quarantine"):
        jaxstep.Recover(quarantine="yes")


def test_a_data_fault_is_quarantined_and_its_step_trained_on_the_healthy_chunks(backend, tmp_path):
    dev = jax.devices()[3]
    fault = Fault("input", dev.id, step=2, mode="data", example=1)
    batches = make_batches(5)
    step = _step(backend, faults=[fault])
    history = jaxstep.History()
    state = jaxstep.fit(
        step,
        step.init(init_params()),
        batches,
        recover=jaxstep.Recover(),
        history=history,
        checkpoint_dir=tmp_path,
    )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "data", "quarantined")
    assert record.device_ids == (dev.id,) and record.examples == (3 * PER_DEVICE + 1,)
    assert record.batch == 2
    assert history.dropped == [(), (), (), (dev.id,), (), ()]  # the step run again
    assert jaxstep.read_quarantine(tmp_path) == {2: (3 * PER_DEVICE + 1,)}
    # the same update as a step that leaves the failing chunk out of its mean
    reference = _clean(backend, batches, faults=[fault], on_failure="drop")
    chex.assert_trees_all_close(host_params(step, state), reference, rtol=1e-6, atol=1e-7)


def _carried(batches, first, n):
    """The batches a run on ``n`` devices trains from ``batches[first:]`` under the
    carry rule: the largest multiple of ``n`` of the rows at hand, in order."""
    rows = {k: np.concatenate([b[k] for b in batches[first:]]) for k in batches[0]}
    out, at, held = [], 0, 0
    for b in batches[first:]:
        held += len(b["x"])
        keep = held // n * n
        if keep:
            out.append({k: v[at : at + keep] for k, v in rows.items()})
            at, held = at + keep, held - keep
    return out, at, len(rows["x"])


def test_a_bad_device_is_excluded_and_every_row_trained_on_the_others(backend):
    devices = jax.devices()
    dev = devices[5]
    faults = [Fault("loss", dev.id, step=t, mode="device") for t in range(2, 9)]
    batches = make_batches(7)
    step = _step(backend, faults=faults)
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="not trained"):
        state = jaxstep.fit(
            step, step.init(init_params()), batches, recover=jaxstep.Recover(), history=history
        )
    (record,) = history.recoveries
    assert (record.step, record.verdict, record.action) == (2, "device", "excluded")
    assert record.device_ids == (dev.id,)
    assert [d.id for d in step.devices] == [d.id for d in devices if d != dev]
    # the rest, on 7 devices: 32-row batches carried over into 28, 35, 28, ... rows
    rest = [d for d in devices if d != dev]
    reference_step = _step(backend, devices=rest)
    head = _step(backend)
    start = jaxstep.fit(head, head.init(init_params()), batches[:2])
    again, trained, total = _carried(batches, 2, len(rest))
    expected = jaxstep.fit(
        reference_step, reference_step.place_state(head.host_state(start)), again
    )
    assert history.step[3:] == list(range(2, 2 + len(again)))
    assert not any(s.any() for s in history.status[3:])
    assert history.left_over == [(6, 32 - (total - trained), 32)]
    chex.assert_trees_all_close(
        host_params(step, state), host_params(reference_step, expected), rtol=1e-6, atol=1e-7
    )
    # the history keeps a column per device the run started with
    arrays = history.as_arrays()
    assert arrays["status"].shape == (len(history.step), 8)
    assert np.isnan(arrays["device_loss"][3:, 5]).all()


def test_a_resume_after_a_device_left_goes_on_from_the_row_it_stopped_at(backend, tmp_path):
    """A checkpoint taken while rows are carried holds a data position inside a batch:
    the resumed run trains exactly the rows the first run had not."""
    devices = jax.devices()
    dev = devices[5]
    faults = [Fault("loss", dev.id, step=t, mode="device") for t in range(2, 9)]
    batches = make_batches(7)
    whole = _step(backend, faults=faults)
    with pytest.warns(UserWarning, match="not trained"):
        expected = jaxstep.fit(whole, whole.init(init_params()), batches, recover=jaxstep.Recover())
    first = _step(backend, faults=faults)
    with pytest.warns(UserWarning, match="not trained"):
        jaxstep.fit(
            first,
            first.init(init_params()),
            batches,
            num_steps=5,
            recover=jaxstep.Recover(),
            checkpoint_dir=tmp_path,
            checkpoint_every=2,
        )
    # step 4's checkpoint: 28 + 35 rows of 7 devices trained since batch 2, 63 = 32 + 31
    meta = json.loads((tmp_path / "4" / "meta" / "metadata").read_text())
    assert (meta["data"]["index"], meta["data"]["rows"]) == (3, 31)
    # the run's end (num_steps): 1 + 32 rows, 28 trained, 5 of batch 4 still carried
    end = json.loads((tmp_path / "5" / "meta" / "metadata").read_text())["data"]
    assert (end["index"], end["rows"], end["carried"]) == (4, 27, True)
    rest = _step(backend, devices=[d for d in devices if d != dev])
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="not trained"):
        state = jaxstep.fit(
            rest,
            rest.init(init_params()),
            batches,
            resume=True,
            checkpoint_dir=tmp_path,
            history=history,
        )
    assert history.left_over == [(6, 32 - 160 % 7, 32)]  # 5 batches of 32 rows on 7
    chex.assert_trees_all_close(
        host_params(rest, state), host_params(whole, expected), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("at", [0, 4])
def test_the_first_and_the_last_step_recover_too(backend, at):
    """Step 0 has no step before it in flight; the last is settled by the drain."""
    dev = jax.devices()[1]
    batches = make_batches(5)
    step = _step(backend, faults=[Fault("grad", dev.id, step=at, mode="transient")])
    history = jaxstep.History()
    state = jaxstep.fit(
        step, step.init(init_params()), batches, recover=jaxstep.Recover(), history=history
    )
    assert [(r.step, r.action) for r in history.recoveries] == [(at, "retried")]
    assert int(step.host_state(state).step) == 5
    chex.assert_trees_all_equal(host_params(step, state), _clean(backend, batches))


def test_an_exception_after_a_recovery_hands_back_every_untrained_batch(backend):
    """A callback's exception right after a retry: the batch queued again is in
    error.batches, with the others pulled and not trained, in order."""
    dev = jax.devices()[1]
    batches = make_batches(5)
    step = _step(backend, faults=[Fault("grad", dev.id, step=2, mode="transient")])

    class Stop:
        def on_recovery(self, record):
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here") as info:
        jaxstep.fit(
            step,
            step.init(init_params()),
            batches,
            recover=jaxstep.Recover(),
            callbacks=[Stop()],
        )
    err = info.value
    assert int(step.host_state(err.state).step) == 2
    # the retried batch, the one after it, and any the prefetch pulled ahead, in order
    assert 2 <= len(err.batches) <= 3
    assert all(b is x for b, x in zip(err.batches, batches[2:], strict=False))


def test_a_bad_example_after_a_device_left_is_quarantined_where_it_is_in_the_data(
    backend, tmp_path
):
    """Once rows are carried a step's batch spans two of the data's batches: the
    quarantine file names the data's batch and row, not the step's."""
    faults = [Fault("loss", 5, step=t, mode="device") for t in range(2, 9)]
    faults.append(Fault("input", 2, step=4, mode="data", example=2))
    step = _step(backend, faults=faults)
    history = jaxstep.History()
    with pytest.warns(UserWarning, match="not trained"):
        jaxstep.fit(
            step,
            step.init(init_params()),
            make_batches(6),
            recover=jaxstep.Recover(),
            history=history,
            checkpoint_dir=tmp_path,
        )
    assert [(r.step, r.action) for r in history.recoveries] == [(2, "excluded"), (4, "quarantined")]
    # step 2: rows 0..27 of batch 2; step 3: 28..31 and 0..30 of batch 3; step 4: row 31
    # of batch 3 and rows 0..26 of batch 4, on 7 devices of 4 rows: position 2's example
    # 2 is the step's row 10, batch 4's row 9
    assert history.recoveries[1].examples == (10,)
    assert jaxstep.read_quarantine(tmp_path) == {4: (9,)}


def test_presplit_batches_recover(backend):
    dev = jax.devices()[3]
    batches = make_batches(5)
    split = [{k: v.reshape(8, -1, *v.shape[1:]) for k, v in b.items()} for b in batches]
    step = _step(backend, faults=[Fault("input", dev.id, step=2, mode="data", example=1)])
    history = jaxstep.History()
    jaxstep.fit(
        step,
        step.init(init_params()),
        split,
        presplit=True,
        recover=jaxstep.Recover(),
        history=history,
    )
    (record,) = history.recoveries
    assert (record.action, record.examples) == ("quarantined", (3 * PER_DEVICE + 1,))


def test_the_budget_is_one_fit_calls_even_with_a_history_shared_between_fits(backend):
    dev = jax.devices()[2].id
    faults = [Fault("input", dev, step=t, mode="transient") for t in (1, 4)]
    step = _step(backend, faults=faults)
    history, batches = jaxstep.History(), make_batches(6)
    recover = jaxstep.Recover(max_recoveries=1)
    state = jaxstep.fit(
        step, step.init(init_params()), batches[:3], history=history, recover=recover
    )
    jaxstep.fit(step, state, batches[3:], history=history, recover=recover)
    assert [(r.step, r.action) for r in history.recoveries] == [(1, "retried"), (4, "retried")]


def test_a_later_fit_with_the_same_step_and_history_goes_on_without_the_device(backend):
    """An epoch loop: the step that lost a device in one fit call trains the next
    call's batches (laid out for 8 devices) on 7, and the shared history keeps a column
    for each of the 8."""
    faults = [Fault("loss", 5, step=t, mode="device") for t in range(2, 12)]
    step = _step(backend, faults=faults)
    history, batches = jaxstep.History(), make_batches(8)
    with pytest.warns(UserWarning, match="not trained"):
        state = jaxstep.fit(
            step, step.init(init_params()), batches[:4], history=history, recover=jaxstep.Recover()
        )
    assert len(history.as_arrays()["status"][0]) == 8  # read between the fits
    with pytest.warns(UserWarning, match="not trained"):
        state = jaxstep.fit(step, state, batches[4:], history=history, recover=jaxstep.Recover())
    assert [r.action for r in history.recoveries] == ["excluded"]
    assert history.device_ids == [d.id for d in jax.devices()]
    arrays = history.as_arrays()
    assert arrays["status"].shape == (len(history.step), 8)
    assert np.isnan(arrays["device_loss"][3:, 5]).all() and not arrays["status"][3:].any()
    # each fit's last batch (counted from the first batch that fit was given) left rows
    assert [b for b, _, _ in history.left_over] == [3, 3]


def test_a_spike_after_a_device_left_lists_the_rows_its_rollback_skipped(backend, tmp_path):
    """Steps of carried rows span the data's batches: the record names each one touched
    and the rows skipped of it."""
    spike = jaxstep.LossSpike(window=8, warmup=3, sigmas=50.0)
    faults = [Fault("loss", 5, step=t, mode="device") for t in range(5, 30)]
    step = _step(backend, loss_spike=spike, faults=faults)
    history = jaxstep.History()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxstep.fit(
            step,
            step.init(init_params()),
            _spiky_batches(12, spike_at=6),
            recover=jaxstep.Recover(rollback_batches=1),
            history=history,
            checkpoint_dir=tmp_path,
            checkpoint_every=4,
        )
    # the checkpoint of step 4, from 8 devices, keeps the 7 devices' loss windows
    assert [" carried after a device left" in str(w.message) for w in caught] == [True]
    # (the spiky batch's last row, still carried, spikes again later: a second rollback)
    excluded, rolled = history.recoveries[:2]
    assert (excluded.step, excluded.action, rolled.step, rolled.action) == (
        5,
        "excluded",
        6,
        "rolled back",
    )
    # step 5 (again, on 7 devices): rows 0..27 of batch 5; step 6: 28..31 of 5, 0..30 of 6
    assert rolled.skipped_batches == (5, 6)
    assert "batch 5 rows 28..31, batch 6 rows 0..30" in rolled.detail

"""fit's driver step by step: each named step of jaxstep._src.loop.Loop alone, and the
fan-out of each hook to the listeners that have it (the callbacks among them)."""

import warnings

import jax
import numpy as np
import optax
import pytest

import jaxstep
from jaxstep._src.checkpoint import begin_fit
from jaxstep._src.loop import Loop
from jaxstep._src.loop._action import Runner
from jaxstep._src.loop._actions import Actions
from jaxstep._src.loop._callbacks import listener
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._outcome import Settled
from jaxstep._src.loop._prefetch import InTurn
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches
from tests.models import rows_of


def _loop(step, batches, **kw):
    state, _, saver = begin_fit(
        runtime_of(step),
        step.init(init_params()),
        batches,
        checkpoint_dir=None,
        checkpoint_every=None,
        keep=3,
        resume=False,
    )
    loop = Loop(step, state, FitCheckpoints(saver), **kw)
    loop.start()
    return loop


def _host_step(step, state):
    return int(np.asarray(step.host_state(state).step))


class _Recorder:
    def __init__(self):
        self.calls = []

    def on_step_end(self, table):
        self.calls.append(("step_end", table.step))

    def on_failure(self, error):
        self.calls.append(("failure", error.step))


def test_advance_settles_the_step_before_it_and_drain_the_last(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(2)
    recorder = _Recorder()
    loop = _loop(step, batches, callbacks=[recorder])
    loop.advance(batches[0])
    assert loop.flight.pending is not None and loop.flight.pending.number == 0
    assert loop.flight.pending.batch is batches[0]
    assert loop.history.step == [] and recorder.calls == []  # nothing read yet
    loop.advance(batches[1])
    assert loop.history.step == [0]  # step 0 settled once step 1 was dispatched
    assert loop.flight.pending.number == 1
    loop.drain()
    assert loop.flight.pending is None
    assert loop.history.step == [0, 1]
    assert recorder.calls == [("step_end", 0), ("step_end", 1)]
    assert _host_step(step, loop.finish()) == 2


def test_drain_with_nothing_in_flight_reads_no_table(backend, monkeypatch):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    read = []
    monkeypatch.setattr(step, "table", lambda out: read.append(out))
    loop = _loop(step, [])
    state = loop.state
    loop.drain()
    assert read == [] and loop.history.step == [] and loop.flight.pending is None
    assert loop.finish() is state  # nothing dispatched: the state fit was given


def test_settle_of_a_failed_step_hands_back_every_untrained_batch(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(3)
    batches[1]["poison"][rows_of(3)] = 1.0  # an inf gradient on devices[3] at step 1
    recorder = _Recorder()
    loop = _loop(step, batches, callbacks=[recorder])
    loop.advance(batches[0])
    loop.advance(batches[1])
    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        loop.advance(batches[2])  # settles step 1 with batch 2 already pulled
    err = info.value
    assert (err.device_id, err.step, err.status) == (
        step.devices[3].id,
        1,
        jaxstep.Status.GRAD_NONFINITE,
    )
    assert [f.device_id for f in err.failures] == [step.devices[3].id]  # no one else blamed
    assert [id(b) for b in err.batches] == [id(batches[1]), id(batches[2])]  # untrained
    assert _host_step(step, err.state) == 1  # the state after step 0: the last good one
    assert recorder.calls == [("step_end", 0), ("step_end", 1), ("failure", 1)]


def test_a_rejected_batch_settles_the_step_before_it_and_abandon_keeps_the_state(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(2)
    loop = _loop(step, batches)
    loop.advance(batches[0])
    loop.advance(batches[1])
    before = loop.state
    short = {k: v[:30] for k, v in make_batches(1)[0].items()}  # 30 rows over 8 devices
    with pytest.raises(ValueError) as info:
        loop.advance(short)
    assert info.value.state is before
    assert loop.history.step == [0, 1]  # the step in flight was settled first
    loop.abandon(info.value)
    assert loop.state is before
    assert _host_step(step, loop.state) == 2


def test_a_batch_the_carry_cannot_take_is_handed_back():
    """Whatever raises before a batch is dispatched (the carry, say), the batch is in
    err.batches: pulled, never lost."""
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2))
    batches = make_batches(1)
    loop = _loop(step, batches)

    class Refuse:
        def take(self, item):
            raise ValueError("refused")

        def release(self):
            return []

    loop.carry = Refuse()
    with pytest.raises(ValueError, match="refused") as info:
        loop.advance(batches[0])
    loop.abandon(info.value)
    assert [b is batches[0] for b in info.value.batches] == [True]


def test_with_the_step_watchdog_advance_settles_its_own_step(backend):
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), backend=backend)
    batches = make_batches(2)
    loop = _loop(step, batches, step_timeout=60.0)
    loop.advance(batches[0])
    assert loop.flight.pending is None and loop.history.step == [0]
    loop.advance(batches[1])
    loop.drain()
    assert loop.history.step == [0, 1] and loop.number == 2


def test_settling_returns_what_the_loop_does_next_and_an_exclusion_swaps_in_a_new_step(backend):
    """A settled step says what comes next (no exception for control flow); a recovery
    that leaves a device out hands the loop a new step, swapped in with the state: the
    runtime the run started on is unchanged, and the step fit was given follows."""
    fault = Fault("grad", jax.devices()[5].id, step=1, mode="device")
    step = jaxstep.make_train_step(
        loss_fn, optax.sgd(0.1), backend=backend, faults=[fault], divergence_every=None
    )
    before = runtime_of(step)
    batches = make_batches(2)
    loop = _loop(step, batches, recover=jaxstep.Recover())
    loop.advance(batches[0])
    pending, loop.flight.pending = loop.flight.pending, None
    assert loop.settle(pending) is Settled.GO_ON and loop.number == 1
    loop.advance(batches[1])
    pending, loop.flight.pending = loop.flight.pending, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert loop.settle(pending) is Settled.RECOVERED
    assert [item.seq for item in loop.flight.queue] == [1]  # queued again, on 7 devices
    assert loop.step is not step and len(loop.step.devices) == 7 and loop.number == 1
    assert len(before.devices) == 8  # the runtime the run started on is unchanged
    assert runtime_of(step) is runtime_of(loop.step)  # step.devices shrinks, as documented
    loop._run_queue()
    loop.drain()
    with pytest.warns(UserWarning, match="4 row"):  # 32 rows on 7 devices: 28 trained
        assert _host_step(loop.step, loop.finish()) == 2


def test_callbacks_call_only_the_hooks_each_callback_has_in_order():
    calls = []

    class EndOnly:
        def on_fit_end(self, history):
            calls.append(("end-only", "end", history))

    class Every:
        def __init__(self, name):
            self.name = name

        def on_fit_start(self, step, history):
            calls.append((self.name, "start", step))

        def on_step_end(self, table):
            calls.append((self.name, "step_end", table))

        def on_failure(self, error):
            calls.append((self.name, "failure", error))

        def on_fit_end(self, history):
            calls.append((self.name, "end", history))

    def fan_out(callbacks):  # as fit binds them: each callback a listener, adapted once
        parts = [listener(callback) for callback in callbacks]
        return Actions(parts, Runner(), InTurn(), shows_recoveries=False)

    hooks = fan_out([Every("a"), object(), EndOnly(), Every("b")])
    hooks.on_fit_start("S", "H")
    for step_end in hooks.on_step_end:
        step_end("T")
    hooks.on_failure("E")
    hooks.on_fit_end("H")
    assert calls == [
        ("a", "start", "S"),
        ("b", "start", "S"),
        ("a", "step_end", "T"),
        ("b", "step_end", "T"),
        ("a", "failure", "E"),
        ("b", "failure", "E"),
        ("a", "end", "H"),
        ("end-only", "end", "H"),
        ("b", "end", "H"),
    ]
    empty = fan_out([object()])
    assert empty.on_step_end == ()  # no callback has the hook: nothing to call
    for hook in (empty.on_failure, empty.on_fit_end):
        hook(None)  # no callback has the hook: nothing to call, no error

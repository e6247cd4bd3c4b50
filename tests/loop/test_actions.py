"""fit's options and actions: one FitOptions checked when built, with the messages fit
gives; a run has only the actions it asks for, in their documented order; what an
action warns names the caller of fit."""

import jax
import optax
import pytest

import jaxstep
from jaxstep._src.checkpoint import CheckpointOptions
from jaxstep._src.checkpoint import begin_fit
from jaxstep._src.loop import FitOptions
from jaxstep._src.loop import Loop
from jaxstep._src.loop._actions import Direct
from jaxstep._src.loop._checkpoints import FitCheckpoints
from jaxstep._src.loop._diagnose import Replay
from jaxstep._src.loop._prefetch import InTurn
from jaxstep._src.loop._prefetch import Prefetch
from jaxstep._src.loop._recover import SelfHealing
from jaxstep._src.loop._watchdog import StepWatchdog
from jaxstep._src.step import runtime_of
from jaxstep.testing import Fault
from tests.models import init_params
from tests.models import loss_fn
from tests.models import make_batches


def _loop(step, options):
    state, _, saver = begin_fit(
        runtime_of(step), step.init(init_params()), make_batches(1), options.checkpoints
    )
    return Loop(step, state, FitCheckpoints(saver), options)


@pytest.mark.parametrize(
    "options, kwargs, error, message",
    [
        (
            FitOptions,
            {"num_steps": -1},
            ValueError,
            "num_steps must be an int >= 0 or None, got -1",
        ),
        (
            FitOptions,
            {"num_steps": "3"},
            TypeError,
            "num_steps must be an int >= 0 or None, got '3'",
        ),
        (
            FitOptions,
            {"step_timeout": 0},
            ValueError,
            "step_timeout must be a number of seconds > 0",
        ),
        (FitOptions, {"recover": {}}, TypeError, "recover must be a jaxstep.Recover or None"),
        (CheckpointOptions, {"keep": 0}, ValueError, "keep must be an int >= 1 or None (keep all)"),
        (
            CheckpointOptions,
            {"checkpoint_every": 2},
            ValueError,
            "checkpoint_every=2 needs checkpoint_dir",
        ),
        (CheckpointOptions, {"resume": True}, ValueError, "resume=True needs checkpoint_dir"),
        (FitOptions, {"diagnose": "yes"}, TypeError, "diagnose must be None"),
        (
            jaxstep.Recover,
            {"max_recoveries": True},
            ValueError,
            "Recover(max_recoveries=...) must be",
        ),
    ],
)
def test_options_are_checked_once_when_built_with_the_messages_fit_gives(
    options, kwargs, error, message
):
    with pytest.raises(error) as info:
        options(**kwargs)
    assert message in str(info.value)


def test_one_callback_object_is_kept_as_a_tuple_of_one():
    progress = jaxstep.Progress()
    assert FitOptions(callbacks=progress).callbacks == (progress,)
    assert FitOptions(callbacks=None).callbacks == ()


def test_a_plain_run_prefetches_replays_a_failure_alike_and_dispatches_on_this_thread():
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
    bare = _loop(step, FitOptions(diagnose=False, prefetch=0)).actions
    assert [type(part) for part in bare.parts] == [InTurn, Direct]  # the two roles
    assert bare.read == bare.before == bare.settled == bare.dispatched == ()  # no hooks
    # prefetch=2: a thread pulls the batches ahead; diagnose=None: a failure every
    # device had alike is replayed
    loop = _loop(step, FitOptions())
    prefetch, direct, replay = loop.actions.parts
    assert isinstance(prefetch, Prefetch) and loop.actions.feeder is prefetch
    assert isinstance(replay, Replay) and not replay.every
    assert isinstance(direct, Direct) and loop.actions.runner is direct
    assert direct.settles_at_once is False
    assert loop.actions.before == loop.actions.settled == ()
    # a hook is bound only on the parts that override Action's no-op
    assert [hook.__self__ for hook in loop.actions._failed] == [prefetch, replay]


def test_the_actions_a_run_asks_for_come_in_their_documented_order(tmp_path):
    step = jaxstep.make_train_step(loss_fn, optax.sgd(0.1))
    options = FitOptions(
        callbacks=[jaxstep.Progress()],
        diagnose=True,
        step_timeout=60.0,
        checkpoints=CheckpointOptions(tmp_path, checkpoint_every=2),
        recover=jaxstep.Recover(),
    )
    loop = _loop(step, options)
    try:
        kinds = [type(part) for part in loop.actions.parts]
        # the user's callbacks are listeners in the same list, in the order given
        progress = jaxstep.Progress
        assert kinds == [Prefetch, FitCheckpoints, StepWatchdog, progress, SelfHealing, Replay]
        assert loop.actions.runner.settles_at_once is True  # the watchdog runs the dispatch
    finally:
        loop.actions.close()


def test_the_warning_of_rows_never_trained_names_the_line_that_called_fit():
    devices = jax.devices()
    faults = [Fault("loss", devices[5].id, step=t, mode="device") for t in range(2, 9)]
    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-2), faults=faults)
    with pytest.warns(UserWarning, match="not trained") as caught:
        jaxstep.fit(step, step.init(init_params()), make_batches(7), recover=jaxstep.Recover())
    (warning,) = [w for w in caught if "not trained" in str(w.message)]
    assert warning.filename == __file__

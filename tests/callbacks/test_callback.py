"""jaxstep.Callback, the one protocol of fit's listeners: a subclass is bound only for the
hooks it overrides, a plain object with some of the hooks still works, the shipped
callbacks are Callbacks, and a callback hears fit after fit's own parts where the order
matters (the final checkpoint written before on_fit_end, the emergency save done
before on_failure)."""

import jax
import pytest

import jaxstep
from jaxstep._src.loop._action import Runner
from jaxstep._src.loop._actions import Actions
from jaxstep._src.loop._callbacks import listener
from jaxstep._src.loop._prefetch import InTurn
from jaxstep.testing import Fault
from jaxstep.testing import tiny_step


class Calls(jaxstep.Callback):
    """Writes down the hooks it overrides (not on_recovery, on_failure)."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def on_fit_start(self, step, history):
        self.calls.append((self.name, "start"))

    def on_step_end(self, table):
        self.calls.append((self.name, "step", int(table.step)))

    def on_fit_end(self, history):
        self.calls.append((self.name, "end", len(history)))


class Plain:
    """A callback written before jaxstep.Callback: duck-typed, two of the hooks."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def on_step_end(self, table):
        self.calls.append((self.name, "step", int(table.step)))

    def on_fit_end(self, history):
        self.calls.append((self.name, "end", len(history)))


class EndOnly(jaxstep.Callback):
    def on_fit_end(self, history):
        pass


def test_a_listener_is_bound_only_for_the_hooks_it_overrides():
    end_only, plain = EndOnly(), Plain("p", [])
    actions = Actions([end_only, listener(plain)], Runner(), InTurn(), shows_recoveries=False)
    assert [hook.__self__ for hook in actions._on_fit_end] == [end_only, plain]
    assert [hook.__self__ for hook in actions.on_step_end] == [plain]
    assert actions._on_fit_start == actions._on_recovery == actions._on_failure == ()
    assert actions.pulled == actions.before == actions.read == actions.settled == ()


def test_the_shipped_callbacks_are_callbacks():
    shipped = (jaxstep.Progress, jaxstep.JsonlWriter, jaxstep.TensorBoardWriter, jaxstep.CluWriter)
    assert all(issubclass(cls, jaxstep.Callback) for cls in shipped)


def test_callbacks_and_plain_objects_hear_fit_in_the_order_given():
    tiny = tiny_step(divergence_every=None)
    calls = []
    callbacks = [Calls("a", calls), Plain("p", calls), Calls("b", calls)]
    jaxstep.fit(tiny.step, tiny.state(), tiny.batches(2), callbacks=callbacks, prefetch=0)
    assert calls == [
        ("a", "start"),
        ("b", "start"),
        ("a", "step", 0),
        ("p", "step", 0),
        ("b", "step", 0),
        ("a", "step", 1),
        ("p", "step", 1),
        ("b", "step", 1),
        ("a", "end", 2),
        ("p", "end", 2),
        ("b", "end", 2),
    ]


def test_the_final_checkpoint_is_written_before_on_fit_end(tmp_path):
    tiny = tiny_step(divergence_every=None)
    seen = {}

    class Look(jaxstep.Callback):
        def on_fit_end(self, history):
            seen["steps"] = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())

    jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), checkpoint_dir=tmp_path, callbacks=Look())
    assert seen["steps"] == ["3"]


def test_the_emergency_save_is_done_before_on_failure(tmp_path):
    fault = Fault("loss", jax.devices()[1].id, step=1)
    tiny = tiny_step(divergence_every=None, faults=[fault])
    seen = {}

    class Look(jaxstep.Callback):
        def on_failure(self, error):
            seen["checkpoint"] = error.checkpoint

    with pytest.raises(jaxstep.TrainingWorkerError) as info:
        jaxstep.fit(
            tiny.step, tiny.state(), tiny.batches(3), checkpoint_dir=tmp_path, callbacks=Look()
        )
    assert seen["checkpoint"] is not None and seen["checkpoint"] == info.value.checkpoint


def test_a_callback_s_own_methods_named_like_the_loop_s_hooks_are_never_called():
    """A Callback hears the five Callback hooks alone: its methods that share a name
    with a hook of the loop's (a writer's close, a read, a finish) are its own."""
    heard = []

    class Writer(jaxstep.Callback):
        def on_step_end(self, table):
            heard.append("on_step_end")

        def on_fit_end(self, history):
            heard.append("on_fit_end")

        def close(self):
            heard.append("close")

        def read(self, *args):
            heard.append("read")

        def finish(self, *args):
            heard.append("finish")

        def before(self, *args):
            heard.append("before")

    tiny = tiny_step(divergence_every=None)
    jaxstep.fit(tiny.step, tiny.state(), tiny.batches(2), callbacks=[Writer()])
    assert heard == ["on_step_end", "on_step_end", "on_fit_end"]

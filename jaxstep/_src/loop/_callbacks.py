"""The hooks :func:`jaxstep.fit` calls on a callback, and one object that fans each
call out to every callback that has the hook (CLU's ``MultiWriter``), resolved once per
fit call: the loop's callbacks action.

A callback is any object with some of the hooks (docs/fit.md):
``on_fit_start(step, history)``, ``on_step_end(table)``, ``on_recovery(record)``,
``on_failure(error)`` and ``on_fit_end(history)``."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop._action import Action
from jaxstep._src.loop._history import History
from jaxstep._src.loop._records import Recovery
from jaxstep._src.step import TrainStep

#: The hooks fit calls on a callback, in the order of a run.
HOOKS = ("on_fit_start", "on_step_end", "on_recovery", "on_failure", "on_fit_end")


class Callbacks(Action):
    """Every callback's hooks as one callback, the loop's callbacks action: each
    ``on_...`` call goes to the callbacks that define it, in the order given. Which
    callback has which hook is looked up once, here, not at each step.

    >>> class Count:
    ...     steps = 0
    ...     def on_step_end(self, table):
    ...         self.steps += 1
    >>> count = Count()
    >>> hooks = Callbacks([count, object()])
    >>> hooks.on_step_end(None); hooks.on_fit_end(None)  # object() has neither hook
    >>> count.steps
    1
    """

    def __init__(self, callbacks: Iterable[object] = ()):
        callbacks = list(callbacks)
        self._start = _bound(callbacks, "on_fit_start")
        self._step_end = _bound(callbacks, "on_step_end")
        self._recovery = _bound(callbacks, "on_recovery")
        self._failure = _bound(callbacks, "on_failure")
        self._end = _bound(callbacks, "on_fit_end")
        #: whether any callback has a hook (without one, fit leaves this action out)
        self.hooked = any(hasattr(cb, h) for cb in callbacks for h in HOOKS)

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        for hook in self._start:
            hook(step, history)

    def on_step_end(self, table: HealthTable) -> None:
        """After ``history`` has the step (the hot path: a loop over the bound hooks)."""
        for hook in self._step_end:
            hook(table)

    @property
    def show_recoveries(self) -> bool:
        """Whether a callback shows recoveries (has ``on_recovery``): fit then logs
        them at INFO level rather than WARNING, to say each once."""
        return bool(self._recovery)

    def on_recovery(self, record: Recovery) -> None:
        """After ``fit(..., recover=...)`` acted on a failure (``history.recoveries``
        has the record already)."""
        for hook in self._recovery:
            hook(record)

    def on_failure(self, error: TrainingWorkerError) -> None:
        for hook in self._failure:
            hook(error)

    def on_fit_end(self, history: History) -> None:
        """After the last step, when nothing failed."""
        for hook in self._end:
            hook(history)


def _bound(callbacks: list[object], name: str) -> list[Callable[..., Any]]:
    return [getattr(cb, name) for cb in callbacks if hasattr(cb, name)]

"""What :func:`jaxstep.fit` accepts, checked before anything runs: each wrong argument
gets an error naming it, its value and the fix, and the state passed in is untouched."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from jaxstep.core import TrainState
from jaxstep.core import validate
from jaxstep.loop._callbacks import HOOKS
from jaxstep.loop._history import History
from jaxstep.loop._recover import Recover

if TYPE_CHECKING:
    from jaxstep.step import TrainStep


def check_fit(
    step: TrainStep,
    state: Any,
    batches: Any,
    *,
    num_steps: Any,
    history: Any,
    callbacks: Any,
    step_timeout: Any,
    recover: Any = None,
) -> tuple[Any, ...]:
    """Raises for a wrong argument of :func:`jaxstep.fit`; returns the callbacks as a
    tuple (one callback object may be passed without a list)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"state must be a jaxstep.TrainState, got {type(state).__name__}; build it "
            "from the parameters first: state = step.init(params)"
        )
    validate.alive(state)
    if num_steps is not None and (
        isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0
    ):
        error = ValueError if isinstance(num_steps, int) else TypeError
        raise error(f"num_steps must be an int >= 0 or None, got {num_steps!r}")
    if step_timeout is not None and (
        isinstance(step_timeout, bool)
        or not isinstance(step_timeout, (int, float))
        or not step_timeout > 0
    ):
        error = ValueError if isinstance(step_timeout, (int, float)) else TypeError
        raise error(f"step_timeout must be a number of seconds > 0 or None, got {step_timeout!r}")
    if history is not None and not isinstance(history, History):
        raise TypeError(
            f"history must be a jaxstep.History or None, got {type(history).__name__}; "
            "pass history=jaxstep.History() and read it after fit"
        )
    if recover is not None and not isinstance(recover, Recover):
        raise TypeError(
            f"recover must be a jaxstep.Recover or None, got {recover!r}; pass "
            "recover=jaxstep.Recover() (its defaults) or Recover(retries=2, ...)"
        )
    _check_batches(batches)
    return _callbacks(callbacks)


def _check_batches(batches: Any) -> None:
    if isinstance(batches, (Mapping, TrainState, str, bytes)):
        raise TypeError(
            f"batches is one batch (a {type(batches).__name__}), not an iterable of "
            "batches: pass [batch] for one step, a list or generator of batches, or a "
            "callable start -> iterable"
        )
    if not (isinstance(batches, Iterable) or callable(batches)):
        raise TypeError(
            f"batches must be an iterable of batches or a callable start -> iterable, got "
            f"{type(batches).__name__}"
        )


def _callbacks(callbacks: Any) -> tuple[Any, ...]:
    if callbacks is None:
        return ()
    if any(hasattr(callbacks, h) for h in HOOKS):
        return (callbacks,)  # one callback object
    if not isinstance(callbacks, Iterable) or isinstance(callbacks, (str, bytes)):
        raise TypeError(
            f"callbacks must be a list of callback objects, got {type(callbacks).__name__}"
        )
    found = tuple(callbacks)
    for i, cb in enumerate(found):
        if not any(hasattr(cb, h) for h in HOOKS):
            what = getattr(cb, "__name__", type(cb).__name__)
            raise TypeError(
                f"callbacks[{i}] ({what}) has none of the hooks fit calls ({', '.join(HOOKS)})"
                f", so it would never be called; give it one, e.g. a class with "
                "on_step_end(self, table), or jaxstep.Progress()"
            )
    return found

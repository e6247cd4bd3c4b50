"""What :func:`jaxstep.fit` accepts: its keywords as one frozen :class:`FitOptions`
(the checkpoint options and :class:`Recover` inside), checked once when built, and the
checks of the state and the batches. Each wrong argument gets an error naming it, its
value and the fix, before anything runs; the state passed in is untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from jaxstep._src.checkpoint import CheckpointOptions
from jaxstep._src.core import TrainState
from jaxstep._src.core import validate
from jaxstep._src.core import warn
from jaxstep._src.loop._callbacks import HOOKS
from jaxstep._src.loop._history import History


@dataclasses.dataclass(frozen=True)
class Recover:
    """How :func:`jaxstep.fit` recovers from failures instead of raising.

    Attributes:
      retries: how many times a step whose failure does not come back on replay
        (a transient fault) is run again with the same batch, from the last good state;
        counted per batch, afresh when a rollback trains the batch again.
      quarantine: act on a ``data`` verdict: the step again with the chunks holding the
        offending examples left out of the mean, the examples recorded (and, with
        ``checkpoint_dir``, appended to its quarantine file: :func:`read_quarantine`).
      exclude_devices: act on a ``device`` verdict: go on without the device.
      rollback_batches: act on a loss spike (``make_train_step(loss_spike=...)`` and
        ``fit(checkpoint_dir=...)``): restore the last verified checkpoint before it,
        skip the spike's batch and the ``rollback_batches - 1`` before it, and train the
        other batches since the checkpoint again. None: a spike is not recovered.
      max_recoveries: the most actions one fit call takes; the next failure raises
        :class:`~jaxstep.TrainingWorkerError` as without ``recover``, listing them.
      example_id: the batch leaf that identifies each example (``"id"`` for
        ``batch["id"]``, or a path as ``jax.tree_util.keystr`` writes it,
        ``"['meta']['id']"``): an integer array with one value per example, which
        ``loss_fn`` leaves alone. A quarantine records the values of the offending
        examples (``Recovery.example_ids``, the quarantine file's ``ids``), which
        still name them once the data is shuffled: :func:`read_quarantine`'s ``ids``
        are what the data pipeline filters on next epoch. Checked on the first batch.

    Example:
      A fault that does not come back (``mode="transient"``) is retried:

      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=1, mode="transient")])
      >>> history = jaxstep.History()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), history=history,
      ...                     recover=jaxstep.Recover(retries=1))
      >>> int(state.step), [(r.step, r.verdict, r.action) for r in history.recoveries]
      (3, [(1, 'transient', 'retried')])
    """

    retries: int = 1
    quarantine: bool = True
    exclude_devices: bool = True
    rollback_batches: int | None = None
    max_recoveries: int = 10
    example_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("retries", "max_recoveries"):
            value = getattr(self, name)
            if _not_count(value, 0):
                raise ValueError(f"Recover({name}=...) must be an int >= 0, got {value!r}")
        for name in ("quarantine", "exclude_devices"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"Recover({name}=...) must be True or False, got {getattr(self, name)!r}"
                )
        leaf = self.example_id
        if leaf is not None and (not isinstance(leaf, str) or not leaf):
            raise TypeError(
                f"Recover(example_id=...) must be the name of a batch leaf (a str, e.g. "
                f"'id' for batch['id']) or None, got {leaf!r}"
            )
        k = self.rollback_batches
        if k is not None and _not_count(k, 1):
            raise ValueError(
                f"Recover(rollback_batches=...) must be None or an int >= 1 (the spike's "
                f"batch and the k - 1 before it are skipped), got {k!r}"
            )


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """Every keyword of one :func:`jaxstep.fit` call (what each does: its docstring and
    docs/fit.md), checked once here; the loop and its actions read them from it.
    ``callbacks`` is kept as a tuple (one callback object may be passed alone)."""

    num_steps: int | None = None
    until_step: int | None = None
    history: History | None = None
    callbacks: Any = ()
    diagnose: bool | None = None
    step_timeout: float | None = None
    checkpoints: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    presplit: bool = False
    recover: Recover | None = None
    prefetch: int = 2
    global_batches: bool = False

    def __post_init__(self) -> None:
        n = self.num_steps
        if n is not None and _not_count(n, 0):
            error = ValueError if isinstance(n, int) else TypeError
            raise error(f"num_steps must be an int >= 0 or None, got {n!r}")
        until = self.until_step
        if until is not None and _not_count(until, 0):
            error = ValueError if isinstance(until, int) else TypeError
            raise error(
                f"until_step must be an int >= 0 or None (the step the run ends at: "
                f"state.step counts from 0), got {until!r}"
            )
        timeout = self.step_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            error = ValueError if isinstance(timeout, (int, float)) else TypeError
            raise error(f"step_timeout must be a number of seconds > 0 or None, got {timeout!r}")
        if self.diagnose not in (None, True, False):
            raise TypeError(
                f"diagnose must be None (replay a failure every device had alike), True "
                f"(replay every failure) or False (none), got {self.diagnose!r}"
            )
        if _not_count(self.prefetch, 0):
            count = isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool)
            raise (ValueError if count else TypeError)(
                f"prefetch must be an int >= 0, the batches a background thread pulls and "
                f"places ahead of the step, got {self.prefetch!r}; pass prefetch=2 (the "
                "default) or prefetch=0 to pull each batch on the calling thread"
            )
        if self.history is not None and not isinstance(self.history, History):
            raise TypeError(
                f"history must be a jaxstep.History or None, got {type(self.history).__name__}; "
                "pass history=jaxstep.History() and read it after fit"
            )
        if self.recover is not None and not isinstance(self.recover, Recover):
            raise TypeError(
                f"recover must be a jaxstep.Recover or None, got {self.recover!r}; pass "
                "recover=jaxstep.Recover() (its defaults) or Recover(retries=2, ...)"
            )
        if not isinstance(self.global_batches, bool):
            raise TypeError(
                f"global_batches must be True (every process's batches are the whole global "
                f"batch, the same on every process: fit keeps each process's rows) or False "
                f"(each process passes its own rows), got {self.global_batches!r}"
            )
        object.__setattr__(self, "callbacks", _callbacks(self.callbacks))


def limit(options: FitOptions, first: int) -> int | None:
    """The batches a fit call starting at step ``first`` may train: ``num_steps``, and
    no more than ``until_step - first`` (None: until the data ends)."""
    found = options.num_steps
    if options.until_step is not None:
        left = max(options.until_step - first, 0)
        found = left if found is None else min(found, left)
    return found


def check_until_step(options: FitOptions, first: int) -> None:
    """Warns when ``until_step`` lies below ``first``, the step a fit call starts at
    (the restored one, on resume): the call trains nothing, which an ``until_step``
    read as a number of steps would not have meant. At ``until_step`` itself it says
    nothing: a job restarted once it is done trains none, as docs/fit.md says."""
    until = options.until_step
    if until is None or until >= first:
        return
    resumed = options.checkpoints.resume
    where = "the step of the checkpoint resume=True restored" if resumed else "the state's step"
    warn(
        f"fit(until_step={until}) starts at step {first}, {where}, already past the step "
        "it should end at: nothing is trained and the state is returned as given. "
        "until_step is the step a run ends at (counted from 0), not a number of steps: "
        f"to train {until} more steps pass num_steps={until}; to go on past step {first}, "
        "an until_step above it"
    )


def check_inputs(state: Any, batches: Any) -> None:
    """Raises for a ``state`` that is not a live :class:`~jaxstep.TrainState`, or
    ``batches`` that is one batch, or no iterable of batches."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"state must be a jaxstep.TrainState, got {type(state).__name__}; build it "
            "from the parameters first: state = step.init(params)"
        )
    validate.alive(state)
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


def _not_count(value: Any, least: int) -> bool:
    """Whether ``value`` is not an int >= ``least`` (a bool is no count)."""
    return isinstance(value, bool) or not isinstance(value, int) or value < least


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

"""What one fit call says as it runs, and who hears it: :class:`Callback`, the one
protocol every listener of :func:`jaxstep.fit` follows (the loop's own actions extend
it, the shipped callbacks subclass it), and :func:`listener`, a plain object with some
of the hooks taken as one, looked up once when fit starts.

A listener hears a hook only when it overrides it: the loop binds, once per fit call,
the hooks each listener's class defines anew (:class:`jaxstep._src.loop._actions.Actions`);
a hook no listener has costs nothing per step."""

from __future__ import annotations

from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop._history import History
from jaxstep._src.loop._records import Recovery
from jaxstep._src.step import TrainStep

#: The hooks fit calls on a callback, in the order of a run.
HOOKS = ("on_fit_start", "on_step_end", "on_recovery", "on_failure", "on_fit_end")


class Callback:
    """What :func:`jaxstep.fit` tells its callbacks, as methods that do nothing:
    subclass it and override the hooks you need (``fit(..., callbacks=[...])``). Fit
    calls a hook only on the callbacks that override it, in the order given; where the
    order beside fit's own parts matters, they come first: a step's checkpoint copy is
    handed to the writer before ``on_step_end`` hears of the step, a recovery's record
    is in ``history.recoveries`` before ``on_recovery``, the emergency save is done
    before ``on_failure``, and the final checkpoint is written before ``on_fit_end``
    (docs/fit.md). :class:`Progress`,
    :class:`JsonlWriter`, :class:`TensorBoardWriter` and :class:`CluWriter` are
    Callbacks; an object with some of these methods that does not subclass it works
    too.

    Example:
      >>> import jaxstep
      >>> class Losses(jaxstep.Callback):
      ...     def __init__(self):
      ...         self.losses = []
      ...     def on_step_end(self, table):
      ...         self.losses.append(round(float(table.loss.mean()), 3))
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> losses = Losses()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), callbacks=[losses])
      >>> len(losses.losses)
      3
    """

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        """Called once, before the first batch.

        Args:
          step: the step ``fit`` runs.
          history: the :class:`jaxstep.History` ``fit`` fills (empty of this call's
            steps yet).
        """

    def on_step_end(self, table: HealthTable) -> None:
        """Called after each step's table is read, once ``history`` has the step (and
        a checkpoint copy of it, if any, went to the writer).

        Args:
          table: the step's :class:`jaxstep.HealthTable`, one row a device.
        """

    def on_recovery(self, record: Recovery) -> None:
        """Called after ``fit(..., recover=...)`` acted on a failure, once
        ``history.recoveries`` has the record.

        Args:
          record: the :class:`jaxstep.Recovery` taken.
        """

    def on_failure(self, error: TrainingWorkerError) -> None:
        """Called when a :class:`jaxstep.TrainingWorkerError` is about to leave ``fit``
        (the emergency save done: ``error.checkpoint``).

        Args:
          error: the error ``fit`` raises next.
        """

    def on_fit_end(self, history: History) -> None:
        """Called after the last step when nothing failed (the final checkpoint
        written, with checkpoints on).

        Args:
          history: the :class:`jaxstep.History` of the run.
        """


class _Plain(Callback):
    """A plain object with some of the hooks, not a :class:`Callback`, as a listener:
    the hooks it has, looked up once here and held on this adapter itself, so the loop
    binds those and no other."""

    def __init__(self, callback: object):
        self.callback = callback
        for hook in HOOKS:
            if hasattr(callback, hook):
                setattr(self, hook, getattr(callback, hook))


def listener(callback: object) -> Callback:
    """``callback`` as a listener: itself when it is a :class:`Callback`, else adapted
    (users' callbacks that predate the class keep working).

    >>> class Count:
    ...     steps = 0
    ...     def on_step_end(self, table):
    ...         self.steps += 1
    >>> count = Count()
    >>> adapted = listener(count)
    >>> adapted.on_step_end(None); adapted.on_fit_end(None)  # Count has no on_fit_end
    >>> count.steps, listener(adapted) is adapted
    (1, True)
    """
    return callback if isinstance(callback, Callback) else _Plain(callback)


def overrides(part: Callback, hook: str, default: object) -> bool:
    """Whether ``part`` has a ``hook`` of its own, not ``default`` (the base's no-op):
    its class defines it anew, or it holds it itself (an adapted plain object)."""
    return (
        hook in getattr(part, "__dict__", ()) or getattr(type(part), hook, default) is not default
    )

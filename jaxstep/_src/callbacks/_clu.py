"""The CLU writer: a callback for :func:`jaxstep.fit` that hands each step's record,
each recovery and the failure to a CLU ``MetricWriter`` the user already has (the
Flax examples' ``metric_writers.create_default_writer``), so a ported example keeps
its own logging::

    writer = metric_writers.create_default_writer(workdir)
    jaxstep.fit(step, state, batches, callbacks=[jaxstep.CluWriter(writer)])

CLU is never imported here: the writer is used through its methods alone.
"""

from __future__ import annotations

import os
from typing import Any

from jaxstep._src.callbacks._metrics import _Writer
from jaxstep._src.callbacks._step_records import goodput_scalars
from jaxstep._src.callbacks._step_records import step_scalars
from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop import History
from jaxstep._src.loop import Recovery

#: what CluWriter calls on the writer (clu.metric_writers.MetricWriter's methods)
WRITER_METHODS = ("write_scalars", "write_texts", "flush")


def device_text(record: dict[str, Any]) -> str:
    """The devices of a step record that did not simply succeed, in words:
    ``"device 4: GRAD_NONFINITE dropped"``, one per device, ``"; "`` between; empty
    when every device was OK (what a scalar cannot carry: which check failed)."""
    return "; ".join(
        f"device {d['id']}: {d['status']}"
        + (" dropped" if d["dropped"] else "")
        + (" repaired" if d["repaired"] else "")
        for d in record["devices"]
        if d["status"] != "OK" or d["dropped"] or d["repaired"]
    )


class CluWriter(_Writer):
    """Sends each finished step, each recovery and the failure to a CLU metric writer
    (``clu.metric_writers``: ``create_default_writer``, ``AsyncWriter``,
    ``MultiWriter``, ``LoggingWriter``, or any ``MetricWriter``).

    Per step, at its step number, ``write_scalars`` gets the scalars
    :class:`TensorBoardWriter` writes (``loss``, ``examples_per_sec``, ``data_wait``,
    ``skipped``, ``dropped``, ``metrics/<name>``, and ``device_<id>/loss``,
    ``/grad_norm``, ``/failed``, ``/dropped``; a non-finite value is NaN), and on a
    step where a device did not simply succeed ``write_texts`` gets ``devices``, those
    devices in words (``"device 4: GRAD_NONFINITE; device 6: OK repaired"``). Each recovery
    under ``fit(..., recover=...)`` adds the scalar ``recoveries`` (the count so far)
    and the text ``recovery`` (the record in words) at its step; a failure, the text
    ``failure`` (the error's message) at its step. The writer is flushed when ``fit``
    ends and when it fails, so an asynchronous writer has written everything by the
    time ``fit`` returns or raises; it is never closed (it is yours: the examples go on
    to write their evaluation metrics to it).

    Args:
      writer: the CLU writer (anything with ``write_scalars``, ``write_texts`` and
        ``flush``).
      all_processes: write on every process of a multi-host run (the default: the
        writer each process made decides what it writes, as in the Flax examples'
        ``create_default_writer(workdir, just_logging=jax.process_index() > 0)``);
        False writes on process 0 only.

    Raises:
      TypeError: ``writer`` is not a CLU metric writer (a path, say).

    Example:
      With a stand-in for a CLU writer that keeps what it is given
      (``metric_writers.create_default_writer(workdir)`` in a run):

      >>> import jaxstep
      >>> class Writer:
      ...     def __init__(self):
      ...         self.scalars = {}
      ...     def write_scalars(self, step, scalars):
      ...         self.scalars[step] = scalars
      ...     def write_texts(self, step, texts):
      ...         pass
      ...     def flush(self):
      ...         pass
      >>> writer = Writer()
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(2),
      ...                     callbacks=[jaxstep.CluWriter(writer)])
      >>> sorted(writer.scalars)  # the steps, and the run's goodput after the last
      [0, 1, 2]
      >>> "goodput" in writer.scalars[2]
      True
      >>> "loss" in writer.scalars[1], "device_3/grad_norm" in writer.scalars[1]
      (True, True)
    """

    def __init__(self, writer: Any, *, all_processes: bool = True):
        missing = [m for m in WRITER_METHODS if not callable(getattr(writer, m, None))]
        if isinstance(writer, (str, os.PathLike)):
            raise TypeError(
                f"CluWriter takes a CLU metric writer, not a path ({os.fspath(writer)!r}): "
                "CluWriter(clu.metric_writers.create_default_writer(logdir)) (pip install "
                "'jaxstep[clu]'), or jaxstep.TensorBoardWriter(logdir) to write event "
                "files without CLU"
            )
        if missing:
            raise TypeError(
                f"CluWriter takes a CLU metric writer (clu.metric_writers.MetricWriter); "
                f"a {type(writer).__name__} has no {', '.join(missing)}. Make one with "
                "clu.metric_writers.create_default_writer(logdir) (pip install "
                "'jaxstep[clu]')"
            )
        self.writer = writer
        self.all_processes = all_processes
        self.recoveries = 0  # written so far (the ``recoveries`` scalar)

    def on_step_end(self, table: HealthTable) -> None:
        """Called by ``fit`` after each step: its scalars, and the devices that did not
        simply succeed, at its step.

        Args:
          table: the step's :class:`jaxstep.HealthTable`.
        """
        record = self._record(table)
        if not self.writes:
            return
        self.writer.write_scalars(record["step"], step_scalars(record))
        text = device_text(record)
        if text:
            self.writer.write_texts(record["step"], {"devices": text})

    def on_recovery(self, record: Recovery) -> None:
        """Called by ``fit(recover=...)`` after each recovery: the scalar
        ``recoveries`` (the count so far) and the text ``recovery`` at its step.

        Args:
          record: the :class:`jaxstep.Recovery` taken.
        """
        self.recoveries += 1
        if self.writes:
            self.writer.write_scalars(record.step, {"recoveries": float(self.recoveries)})
            self.writer.write_texts(record.step, {"recovery": str(record)})

    def on_failure(self, error: TrainingWorkerError) -> None:
        """Called by ``fit`` when a step fails: the message as the text ``failure`` at
        the failed step, then :meth:`flush`.

        Args:
          error: the :class:`jaxstep.TrainingWorkerError` ``fit`` raises next.
        """
        if self.writes:
            self.writer.write_texts(int(error.step), {"failure": str(error)})
        self.flush()

    def on_fit_end(self, history: History) -> None:
        """Called by ``fit`` when it returns: :meth:`flush` (the writer stays open).

        Args:
          history: the run's :class:`jaxstep.History`.
        """
        if self.writes:
            self.writer.write_scalars(*goodput_scalars(history))
        self.flush()

    def flush(self) -> None:
        """Waits until the writer has written everything it was given (CLU's
        ``AsyncWriter`` writes on a thread of its own)."""
        if self.writes:
            self.writer.flush()

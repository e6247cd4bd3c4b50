"""A progress callback for :func:`jaxstep.fit`: a live ``rich`` bar (step, loss,
examples/s, skipped steps, recoveries, the ``aux`` scalars) in a terminal, plain lines
every few steps elsewhere (logs, CI, notebooks); each recovery as a line when it
happens, and their summary at the end."""

from __future__ import annotations

import collections
import math
import sys
import time
from typing import IO
from typing import TYPE_CHECKING

import numpy as np

from jaxstep._src.core import HealthTable
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.loop import Callback
from jaxstep._src.loop import History
from jaxstep._src.loop import Recovery

if TYPE_CHECKING:
    from rich.progress import Progress as Bar
    from rich.progress import TaskID

    from jaxstep._src.step import TrainStep


def _can_draw(file: IO[str]) -> bool:
    try:
        from rich.console import Console
    except ImportError:
        return False
    if getattr(file, "isatty", lambda: False)():
        return True
    if not Console(file=file).is_jupyter:
        return False
    try:  # rich draws a live display in Jupyter through a widget
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Progress(Callback):
    """Shows a run's progress; add it with ``fit(..., callbacks=[jaxstep.Progress(n)])``.

    Under ``fit(..., recover=...)`` each recovery is printed as it is taken
    (``recovered at step 5: data -> quarantined (device 3); examples [40] of batch 5``),
    counted on the bar (``recovered 1``), and summed up when the run ends
    (:meth:`History.recovery_summary`).

    Args:
      total: the number of steps expected (for the bar), or None.
      every: in plain mode, print a line every this many steps (default: about ten
        lines a run, or every 25 steps when ``total`` is unknown).
      live: force the live bar (True) or plain lines (False); default: live when
        ``rich`` is installed and ``file`` is a terminal, or a Jupyter notebook's
        output with ``ipywidgets`` installed.
      file: where to write (default ``sys.stdout``).

    Example:
      Plain lines (a terminal or a notebook gets a live bar), every step:

      >>> import io, jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> out = io.StringIO()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3),
      ...                     callbacks=[jaxstep.Progress(3, every=1, live=False, file=out)])
      >>> [line.split()[:3] for line in out.getvalue().splitlines()]
      [['step', '0', '(1/3)'], ['step', '1', '(2/3)'], ['step', '2', '(3/3)']]
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        every: int | None = None,
        live: bool | None = None,
        file: IO[str] | None = None,
    ):
        self.total = total
        self.every = every or (max(1, total // 10) if total else 25)
        self.file = file
        self._live = live
        self._bar: Bar | None = None
        self._task: TaskID | None = None
        self._step: TrainStep | None = None
        self.history: History | None = None
        self._done = 0  # steps trained, over every fit this Progress has shown
        self._first: int | None = None  # this fit's first step, and _done before it
        self._before = 0
        # Running totals over the history (skipped steps, device-steps dropped and
        # repaired), kept per step: summing the whole history for each line made a
        # long run's every step slower (O(steps) a line; every step with the live bar).
        self._totals = [0, 0, 0]
        self._drawn = 0.0  # when the live bar's text was last redrawn
        self._ends: collections.deque[float] = collections.deque(maxlen=21)  # step ends

    def _out(self) -> IO[str]:
        return self.file if self.file is not None else sys.stdout

    def on_fit_start(self, step: TrainStep, history: History) -> None:
        """Called by ``fit`` before the first step: starts the live bar (or the plain
        lines). A ``Progress`` passed to several ``fit`` calls goes on counting.

        Args:
          step: the step ``fit`` runs (its ``failures`` name who failed a skipped step).
          history: the :class:`jaxstep.History` ``fit`` fills (what the line shows).
        """
        self.history = history
        self._step = step  # a Progress used for several fits keeps counting
        self._first = None
        self._totals = [  # the history may hold earlier fits' steps: counted once here
            sum(history.skipped),
            sum(len(ids) for ids in history.dropped),
            sum(len(ids) for ids in history.repaired),
        ]
        self._ends.clear()
        live = self._live if self._live is not None else _can_draw(self._out())
        if live and self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn
            from rich.progress import MofNCompleteColumn
            from rich.progress import Progress as Bar
            from rich.progress import TextColumn
            from rich.progress import TimeElapsedColumn
            from rich.table import Column

            # A line wider than the terminal wraps the text; the count and the time
            # stay whole (rich squeezed every column, the count first, to nothing).
            whole = Column(no_wrap=True)
            self._bar = Bar(
                TextColumn("step", table_column=whole),
                MofNCompleteColumn(table_column=Column(no_wrap=True)),
                BarColumn(),
                TimeElapsedColumn(table_column=Column(no_wrap=True)),
                TextColumn("{task.fields[text]}", table_column=Column(ratio=1)),
                console=Console(file=self._out()),
            )
            self._task = self._bar.add_task(
                "train", total=self.total, completed=self._done, text="compiling..."
            )
            self._bar.start()

    def describe(self) -> str:
        """The last finished step in one line, as the bar shows it.

        Returns:
          The loss, examples/s, the ``aux`` scalars, the time the loop waited for data
          (when it is 5% of a step or more) and the counts (skipped, dropped, repaired,
          recovered); ``""`` before the first step.
        """
        h = self.history
        if h is None or not len(h):
            return ""
        # Throughput of the last steps (harmonic mean: equal examples per step), the
        # run's first step left out once there are others: it includes compiling.
        recent = h.examples_per_sec[max(1, len(h) - 20) :] or h.examples_per_sec[-1:]
        rate = (
            len(recent) / sum(1.0 / r for r in recent) if all(r > 0 for r in recent) else math.nan
        )
        parts = [f"loss {h.loss[-1]:.4f}"]
        parts += [f"{k} {v:.4f}" for k, v in h.metrics[-1].items()]
        parts.append(f"{rate:,.0f} ex/s" if math.isfinite(rate) else "- ex/s")
        ends = self._ends
        if len(ends) > 1 and h.data_wait:  # a slow input pipeline, not a slow step
            per_step = (ends[-1] - ends[0]) / (len(ends) - 1)
            waits = h.data_wait[-(len(ends) - 1) :]
            wait = sum(waits) / len(waits)
            if per_step > 0 and wait >= 0.05 * per_step:
                parts.append(f"data {wait * 1e3:,.0f} ms/step ({min(wait / per_step, 1):.0%})")
        skipped, dropped, repaired = self._totals
        parts.append(f"skipped {skipped}")
        if dropped:  # on_failure="drop": device-steps left out of the mean
            parts.append(f"dropped {dropped}")
        if repaired:
            parts.append(f"repaired {repaired}")
        if h.recoveries:  # fit(..., recover=...): actions taken
            parts.append(f"recovered {len(h.recoveries)}")
        return "  ".join(parts)

    def on_step_end(self, table: HealthTable) -> None:
        """Called by ``fit`` after each step: moves the bar (or prints a line every
        ``every`` steps), and says who failed a skipped step or was left out of one.

        Args:
          table: the step's :class:`jaxstep.HealthTable`.
        """
        if self._first is None:
            self._first, self._before = table.step, self._done
        # Counted by step number, not by row: under fit(recover=...) a failed step (its
        # state unchanged) is run again, and a rollback trains steps again.
        trained = table.step + (0 if table.failed and table.halted else 1)
        self._done = self._before + trained - self._first
        self._ends.append(time.perf_counter())
        dropped, repaired = table.dropped.any(), table.repaired.any()
        totals = self._totals
        totals[0] += bool(table.skipped)
        if dropped or repaired:
            totals[1] += int(np.count_nonzero(table.dropped))
            totals[2] += int(np.count_nonzero(table.repaired))
        if table.failed and table.skipped:
            # Under the skip policy nothing is raised: say who failed, once.
            assert self._step is not None, "on_fit_start gives the step"
            failures = "; ".join(
                f"device {f.device_id}: {f.reason}" for f in self._step.failures(table)
            )
            self._print(f"step {table.step} skipped: {failures}")
        elif dropped or repaired:
            # Under the drop policy nothing is raised either: say who was left out.
            assert self._step is not None, "on_fit_start gives the step"
            self._print(f"step {table.step} {self._drops(table)}")
        if self._bar is not None and self._task is not None:  # made together
            now = time.monotonic()
            if now - self._drawn >= 0.1 or self._done == self.total:  # rich redraws 10/s
                self._drawn = now
                self._bar.update(self._task, completed=self._done, text=self.describe())
            else:
                self._bar.update(self._task, completed=self._done)
        elif self._done % self.every == 0 or self._done == self.total:
            of = f"/{self.total}" if self.total else ""
            self._print(f"step {table.step:5d} ({self._done}{of})  {self.describe()}")

    def _drops(self, table: HealthTable) -> str:
        """Who was left out of a step's mean and why, and whose replica was repaired."""
        assert self._step is not None
        devices = self._step.devices
        parts = []
        if table.dropped.any():
            why = {f.device_id: f.reason for f in self._step.failures(table)}
            left = [devices[i].id for i in table.dropped.nonzero()[0]]
            parts.append(
                "left out " + "; ".join(f"device {d}: {why.get(d, 'failed')}" for d in left)
            )
        if table.repaired.any():
            ids = ", ".join(str(devices[i].id) for i in table.repaired.nonzero()[0])
            parts.append(f"repaired the replica of device {ids} from the majority")
        return "; ".join(parts)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)  # above the bar
        else:
            print(line, file=self._out())

    def on_recovery(self, record: Recovery) -> None:
        """Called by ``fit(recover=...)`` after each recovery: prints it, above the bar.

        Args:
          record: the :class:`jaxstep.Recovery` taken.
        """
        self._print(f"recovered at {record}")
        if self._bar is not None and self._task is not None:
            text = self.describe()  # with the new count; "" before the first step
            self._bar.update(self._task, text=text or "compiling...")

    def on_failure(self, error: TrainingWorkerError) -> None:
        """Called by ``fit`` when a step fails: stops the bar (the error itself reaches
        whoever called ``fit``).

        Args:
          error: the :class:`jaxstep.TrainingWorkerError` ``fit`` raises next.
        """
        self.close()

    def on_fit_end(self, history: History) -> None:
        """Called by ``fit`` when it returns: prints the recoveries' summary, if any,
        and stops the bar (its last line shows the run's goodput: :meth:`close`).

        Args:
          history: the run's :class:`jaxstep.History`.
        """
        summary = history.recovery_summary()
        if summary:
            self._print(summary)  # above the bar's last state
        self.close()

    def close(self) -> None:
        """Stops the live bar, showing the last step's line and the run's goodput
        (``history.goodput()``: the share of the time in fit that trained steps kept;
        ``fit`` calls it)."""
        if self._bar is not None:
            if self._task is not None and self.history is not None and len(self.history):
                text = f"{self.describe()}  goodput {self.history.goodput().goodput:.0%}"
                self._bar.update(self._task, text=text)  # the last step's
            self._bar.stop()
            self._bar = None

"""Goodput: the share of a job's time that trained steps whose update was kept and
never undone, and where the rest went (:class:`Goodput`, ``history.goodput()``), read
from the spans the loop wrote into the history's
:class:`~jaxstep._src.loop._ledger.Ledger`."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Protocol

from jaxstep._src.loop._ledger import BUCKETS
from jaxstep._src.loop._ledger import Ledger
from jaxstep._src.loop._ledger import mark_lost


class Steps(Protocol):
    """What a report reads of a :class:`jaxstep.History`: its ledger, and each step's
    number, whether its update was skipped and the devices dropped from it."""

    @property
    def ledger(self) -> Ledger: ...
    @property
    def step(self) -> list[int]: ...
    @property
    def skipped(self) -> list[bool]: ...
    @property
    def dropped(self) -> list[tuple[int, ...]]: ...


#: the buckets of :attr:`Goodput.badput`, in the order the table shows them
BADPUT = (*BUCKETS[:-1], "wasted", "other")
#: the counts of :attr:`Goodput.steps`
STEPS = ("productive", "skipped", "failed", "dropped_chunks", "rolled_back", "lost")


@dataclasses.dataclass(frozen=True)
class Goodput:
    """Where a job's time went (``history.goodput()``): every fit call that filled the
    history and, with ``checkpoint_dir``, every process before a restart.

    Attributes:
      wall_s: the job's wall time in fit: every call, every restart's.
      productive_s: the time of steps whose update was kept and never undone (a step
        under ``drop`` that trained 7 of 8 chunks counts: its dropped chunks are in
        ``steps``).
      badput: seconds per bucket: ``"startup"`` (restoring, building and compiling
        before the first step), ``"data"`` (waiting for batches), ``"checkpoint"``
        (saves on the loop's path, the emergency save), ``"diagnosis"`` (replays),
        ``"recovery"`` (exclusion, re-split, re-shard, repair, recompiling),
        ``"wasted"`` (steps trained and then discarded: skipped, failed, rolled back,
        lost to a crash since the last checkpoint) and ``"other"`` (the loop's own
        time after the last step). ``productive_s + sum(badput.values()) == wall_s``.
      steps: counts: ``"productive"``, ``"skipped"``, ``"failed"``,
        ``"dropped_chunks"`` (chunks left out of kept steps under ``drop``),
        ``"rolled_back"``, ``"lost"``.

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> history = jaxstep.History()
      >>> _ = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(4), history=history)
      >>> report = history.goodput()
      >>> report.steps["productive"], 0.0 < report.goodput <= 1.0
      (4, True)
      >>> round(report.productive_s + sum(report.badput.values()), 9) == round(report.wall_s, 9)
      True
    """

    wall_s: float
    productive_s: float
    badput: dict[str, float]
    steps: dict[str, int]

    @property
    def goodput(self) -> float:
        """``productive_s / wall_s``, in [0, 1] (0 before anything ran)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain JSON values.

        Returns:
          ``{"wall_s", "productive_s", "goodput", "badput": {...}, "steps": {...}}``.
        """
        return {
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "goodput": self.goodput,
            "badput": dict(self.badput),
            "steps": dict(self.steps),
        }

    def __str__(self) -> str:
        wall = self.wall_s
        share = lambda s: f"{100 * s / wall:5.1f}%" if wall > 0 else "    -"  # noqa: E731
        steps = self.steps
        lines = [
            f"jaxstep goodput: {100 * self.goodput:.1f}% of {wall:.2f} s in fit "
            f"({steps['productive']} steps kept)",
            f"  {'productive':<11}{self.productive_s:9.3f} s {share(self.productive_s)}",
        ]
        lost = [
            f"{steps[k]} {k.replace('_', ' ')}"
            for k in STEPS[1:]
            if steps[k] and k != "dropped_chunks"
        ]
        for bucket in BADPUT:
            seconds = self.badput[bucket]
            note = f"  ({', '.join(lost)})" if bucket == "wasted" and lost else ""
            lines.append(f"  {bucket:<11}{seconds:9.3f} s {share(seconds)}{note}")
        if steps["dropped_chunks"]:
            lines.append(f"  ({steps['dropped_chunks']} chunks dropped from kept steps)")
        return "\n".join(lines)

    @classmethod
    def of(cls, history: Any) -> Goodput:
        """The report of ``history`` (what ``history.goodput()`` returns).

        Args:
          history: a :class:`jaxstep.History` that ``fit`` filled (its ledger's spans,
            its steps' outcomes).

        Returns:
          The :class:`Goodput` of every span the history holds.
        """
        badput = dict.fromkeys(BADPUT, 0.0)
        steps = dict.fromkeys(STEPS, 0)
        productive = 0.0
        for bucket, seconds, outcome, chunks in timeline(history):
            if bucket == "productive":
                productive += seconds
                steps["productive"] += 1
                steps["dropped_chunks"] += chunks
            else:
                badput[bucket] += seconds
                if outcome:
                    steps[outcome] += 1
        wall = productive + sum(badput.values())
        return cls(wall, productive, badput, steps)


def timeline(history: Steps) -> list[tuple[str, float, str, int]]:
    """Every span of the job in order (the processes before a restart first): its
    bucket (``"productive"`` or one of :data:`BADPUT`; a step's data wait its own
    ``"data"`` span before it), seconds, for a wasted step why (``"skipped"``,
    ``"failed"``, ``"rolled_back"``, ``"lost"``; else ``""``) and a kept step's
    dropped chunks."""
    ledger = history.ledger
    spans = list(ledger.earlier)
    if ledger.spans:
        numbers, skipped, dropped = history.step, history.skipped, history.dropped
    for bucket, seconds, ref, data in ledger.spans:
        if bucket == "step":
            outcome = "failed" if ref in ledger.failed else "skipped" if skipped[ref] else "ok"
            spans.append(("step", seconds, numbers[ref], outcome, len(dropped[ref]), data))
        elif bucket == "resume":  # what trained at or after it before is lost
            spans = mark_lost(spans, ref)
        else:
            spans.append((bucket, seconds, -1, "", 0, 0.0))
    final: set[int] = set()  # steps trained again later: the earlier ones were undone
    out: list[tuple[str, float, str, int]] = []
    for bucket, seconds, number, outcome, chunks, data in reversed(spans):
        if bucket != "step":
            out.append((bucket if bucket in BADPUT else "other", seconds, "", 0))
            continue
        if outcome == "ok" and number not in final:
            out.append(("productive", seconds, "", chunks))
        else:
            out.append(("wasted", seconds, "rolled_back" if outcome == "ok" else outcome, 0))
        if outcome != "lost":
            final.add(number)
        if data:
            out.append(("data", data, "", 0))
    out.reverse()
    return out

"""Where a run's time went, as fit spends it: the :class:`Ledger` a
:class:`~jaxstep.History` keeps (``history.ledger``), which cuts each fit call's wall
time into consecutive spans, each of one bucket, and the small append-only record of
those spans beside the checkpoints (:class:`Record`) that carries them across a
restart. :class:`jaxstep.Goodput` (``history.goodput()``) reads them.

The cut uses only the timestamps the loop takes anyway. A fit call starts an interval;
the loop closes one at each step it settles (the interval's time, less what was spent
in it on data, checkpoints, diagnosis or recovery, is that step's: productive, or
wasted when its update was skipped, failed, rolled back or lost), at the first dispatch
(its compiling is ``"startup"``) and when the call ends (what is left is ``"other"``).
So the spans add up to each call's wall time, exactly, by construction; the calls'
wall times are also kept as measured, apart (:attr:`Ledger.calls`)."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src.core import processes

#: the buckets of time that is not a step's (``"wasted"`` is steps' time: see Goodput)
BUCKETS = ("startup", "data", "checkpoint", "diagnosis", "recovery", "other")

#: the record's file, beside the checkpoints (written by process 0)
RECORD = "goodput.jsonl"

# A span: (bucket, seconds, ref, data seconds). For "step", ref is the step's index in
# the history (its number, outcome and dropped chunks are read there); for "resume",
# the step a run resumed from (every earlier span of a step at or after it was lost);
# -1 otherwise.
Span = tuple[str, float, int, float]
# A span of an earlier process, read from the record: (bucket, seconds, number, outcome,
# dropped chunks, data seconds); for a step (bucket "step") outcome is "ok", "skipped",
# "failed" or "lost", for another span number is -1 and outcome "".
Earlier = tuple[str, float, int, str, int, float]


class Ledger:
    """The spans of every fit call a :class:`~jaxstep.History` saw (:attr:`spans`, in
    order), the steps of the processes before a restart (:attr:`earlier`, from the
    record), and each call's wall time as measured (:attr:`calls`). Written by the
    loop alone; read by :meth:`jaxstep.History.goodput`."""

    __slots__ = (
        "calls",
        "compiled",
        "compiles_to",
        "cursor",
        "data",
        "earlier",
        "failed",
        "first",
        "nested",
        "opened",
        "record",
        "spans",
        "spent",
    )

    def __init__(self) -> None:
        self.spans: list[Span] = []
        #: the spans of the processes before a restart, in order (from the record)
        self.earlier: list[Earlier] = []
        #: history indices of steps that failed (halted: their update discarded)
        self.failed: set[int] = set()
        #: each fit call's wall time, measured apart from the spans
        self.calls: list[float] = []
        self.first = 0  # where the running fit call's spans begin in :attr:`spans`
        self.cursor = 0.0  # perf_counter when the open interval began
        self.opened = 0.0  # perf_counter when the running fit call began
        self.data = 0.0  # seconds waited for data in the open interval
        self.spent: dict[str, float] = {}  # seconds spent per bucket in the open interval
        self.nested = 0.0  # seconds timed inside the timing that runs now (:meth:`timed`)
        self.compiled = 0.0  # JAX's compiling seconds (:data:`COMPILING`) accounted for
        #: where compiling seen at a step goes: a new variant's (a replica check's, a
        #: replay's) is ``"startup"``, the smaller step's after a device left ``"recovery"``
        self.compiles_to = "startup"
        _listen()
        self.record: Record | None = None  # the record beside the checkpoints, if any

    def begin(self, now: float) -> None:
        """A fit call began at ``now`` (``time.perf_counter()``)."""
        self.cursor = self.opened = now
        self.first = len(self.spans)
        self.data = 0.0
        self.spent = {}
        self.compiled = COMPILING[0]
        self.compiles_to = "startup"

    def spend(self, bucket: str, seconds: float) -> None:
        """``seconds`` of the open interval went to ``bucket`` (a checkpoint's save, a
        replay, a recovery's work)."""
        self.spent[bucket] = self.spent.get(bucket, 0.0) + seconds

    def timed(self, bucket: str, fn: Callable[..., Any]) -> Timed:
        """``fn``, its time spent on ``bucket`` whenever it is called: a checkpoint's
        hooks, a replay, a recovery. A timed call inside another (a recovery's replay)
        is taken out of the outer one's bucket."""
        return Timed(self, bucket, fn)

    def mark(self, bucket: str, now: float) -> None:
        """The open interval ends at ``now`` and what it did not spend otherwise went
        to ``bucket`` (the first dispatch's compiling: ``"startup"``)."""
        data = self.data
        if data:
            self._span("data", data)
            self.data = 0.0
        rest = now - self.cursor - data - self._flush()
        self._span(bucket, rest)
        self.cursor = now
        self.compiled = COMPILING[0]  # what the interval compiled is the bucket's

    def step(self, index: int, now: float) -> float:
        """Step ``index`` (of the history) settled at ``now``: the open interval, less
        what it spent otherwise, was its (the data wait is kept on its span). Returns
        the step's seconds."""
        data = self.data
        if COMPILING[0] != self.compiled:  # a variant compiled on the way: not the step
            self.spend(self.compiles_to, COMPILING[0] - self.compiled)
            self.compiled = COMPILING[0]
        seconds = now - self.cursor - data - (self._flush() if self.spent else 0.0)
        self.spans.append(("step", seconds, index, data))
        self.cursor = now
        self.data = 0.0
        return seconds

    def resumed(self, step: int) -> None:
        """The call resumed from the checkpoint of ``step``: every step at or after it
        trained before (in this history, or by a process before a restart) was lost."""
        self.spans.append(("resume", 0.0, step, 0.0))
        self.earlier = mark_lost(self.earlier, step)
        if self.record is not None:
            self.record.put({"resume": step})

    def close(self, now: float) -> None:
        """The fit call ends at ``now``: the rest of the open interval is ``"other"``."""
        self.mark("other", now)
        self.calls.append(now - self.opened)
        if self.record is not None:
            self.record.put({"call": now - self.opened})
            self.record.close()
            self.record = None

    def agree(self, devices: Sequence[jax.Device], timeout_s: float = 30.0) -> bool:
        """After a fit call over ``devices`` of several processes ended (:meth:`close`):
        every process takes process 0's spans and wall time for it, so
        ``history.goodput()`` says the same on each (process 0's are the ones its record
        beside the checkpoints holds; the steps, their outcomes and a restart's
        ``earlier`` are the same everywhere already, and each process's own clock puts
        a few milliseconds more or less in each bucket). A collective on the
        coordination service: every process of ``devices`` calls it once per fit call
        that ends normally. Returns whether the spans came (False: a process did not
        answer within ``timeout_s``; this process keeps its own)."""
        mine = {"spans": [list(s) for s in self.spans[self.first :]], "call": self.calls[-1]}
        try:
            said = processes.share("goodput", mine, devices, timeout_s=timeout_s)
        except TimeoutError:
            return False
        theirs = said[min(said)]
        self.spans[self.first :] = [
            (str(b), float(s), int(i), float(d)) for b, s, i, d in theirs["spans"]
        ]
        self.calls[-1] = float(theirs["call"])
        return True

    def _flush(self) -> float:
        """The open interval's other spending, as spans; their sum."""
        total = 0.0
        for bucket, seconds in self.spent.items():
            self._span(bucket, seconds)
            total += seconds
        self.spent = {}
        return total

    def _span(self, bucket: str, seconds: float) -> None:
        self.spans.append((bucket, seconds, -1, 0.0))
        if self.record is not None:
            self.record.put({"b": bucket, "s": seconds})


class Timed:
    """A hook (or any function) whose calls' time goes to a bucket of a
    :class:`Ledger` (:meth:`Ledger.timed`); ``__self__`` is the hook's own, as a bound
    method's."""

    __slots__ = ("bucket", "fn", "ledger")

    def __init__(self, ledger: Ledger, bucket: str, fn: Callable[..., Any]):
        self.ledger, self.bucket, self.fn = ledger, bucket, fn

    @property
    def __self__(self) -> Any:
        return getattr(self.fn, "__self__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ledger = self.ledger
        start, outer, compiled = time.perf_counter(), ledger.nested, COMPILING[0]
        ledger.nested = 0.0
        try:
            return self.fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - start
            ledger.spend(self.bucket, took - ledger.nested)
            ledger.nested = outer + took
            ledger.compiled += COMPILING[0] - compiled  # what it compiled is its own


#: seconds JAX spent tracing, lowering and compiling in this process so far (its
#: monitoring events, listened to once a ledger exists)
COMPILING = [0.0]
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_listening: list[bool] = []


def _listen() -> None:
    """Adds up JAX's compiling time into :data:`COMPILING` (registered once)."""
    if _listening:
        return
    _listening.append(True)

    def heard(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event in _COMPILE_EVENTS:
            COMPILING[0] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(heard)


class Record:
    """The append-only record of a run's spans beside its checkpoints
    (``<checkpoint_dir>/goodput.jsonl``, one JSON object a line), written by a thread
    so the loop only queues a line: a step's ``{"n", "s", "o", "d", "w"}`` (number,
    seconds, outcome, dropped chunks, data wait), another span's ``{"b", "s"}``, a
    resume's ``{"resume": step}`` and a call's wall time ``{"call": s}``. A process
    killed between two lines loses at most the lines still queued."""

    def __init__(self, path: str, *, fresh: bool):
        self.path = path
        self._lines: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._file = open(path, "w" if fresh else "a", encoding="utf-8")  # noqa: SIM115
        self._thread = threading.Thread(target=self._write, name="jaxstep-goodput", daemon=True)
        self._thread.start()

    def put(self, line: dict[str, Any]) -> None:
        self._lines.put(line)

    def _write(self) -> None:
        file, lines = self._file, self._lines
        while True:
            line = lines.get()
            if line is None:
                break
            file.write(json.dumps(line, separators=(",", ":")) + "\n")
            if lines.empty():  # caught up: on disk before waiting again
                file.flush()
        file.close()

    def close(self) -> None:
        """Writes what is queued and closes the file."""
        self._lines.put(None)
        self._thread.join(timeout=10.0)


def read_record(path: str) -> tuple[list[Earlier], list[float]]:
    """The spans (in order) and call wall times of a record (an unreadable line, a
    process killed while writing it, is skipped)."""
    spans: list[Earlier] = []
    calls: list[float] = []
    if not os.path.exists(path):
        return spans, calls
    with open(path, encoding="utf-8") as file:
        for text in file:
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if "n" in line:
                spans.append(("step", line["s"], line["n"], line["o"], line["d"], line["w"]))
            elif "resume" in line:
                spans = mark_lost(spans, int(line["resume"]))
            elif "call" in line:
                calls.append(float(line["call"]))
            elif "b" in line:
                spans.append((line["b"], float(line["s"]), -1, "", 0, 0.0))
    return spans, calls


def mark_lost(spans: list[Earlier], step: int) -> list[Earlier]:
    """``spans`` with the steps at or after ``step`` lost (a resume from its checkpoint)."""
    return [s if s[0] != "step" or s[2] < step else (*s[:3], "lost", *s[4:]) for s in spans]


def open_record(ledger: Ledger, checkpoints: Any) -> None:
    """With a checkpoint directory (``checkpoints``: the fit call's
    :class:`~jaxstep._src.loop._checkpoints.FitCheckpoints`): a call that resumed from a
    checkpoint reads the record of the processes before it into ``ledger`` (when the
    history is new to this job: a history that saw them has them) and marks what they
    trained since that checkpoint lost; the record is then appended to (process 0
    writes it), or started anew by a run that did not resume."""
    store = checkpoints.store
    if store is None:
        return
    path = os.path.join(os.fspath(store.directory), RECORD)
    resumed = checkpoints.source.resuming
    new = not ledger.spans and not ledger.earlier
    if resumed and new:
        ledger.earlier, calls = read_record(path)
        ledger.calls[:0] = calls
    if checkpoints.saver.writer:
        ledger.record = Record(path, fresh=new and not resumed)
    if resumed:
        ledger.resumed(checkpoints.first)

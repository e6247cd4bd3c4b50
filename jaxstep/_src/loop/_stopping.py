"""How fit stops early and loses nothing: the batches pulled and not trained, handed
back in the order they were pulled with the data position of the first
(:func:`untrained_batches`); ``err.state``, ``err.batches`` and a note on an exception that
leaves fit (:func:`attach`); and a first Ctrl-C deferred until no state is half donated
(:func:`deferred_interrupts`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

from jaxstep._src.checkpoint import Cursor
from jaxstep._src.core import TrainState
from jaxstep._src.core import validate
from jaxstep._src.loop._carry import starts
from jaxstep._src.loop._carry import untrained_at
from jaxstep._src.loop._pending import Item
from jaxstep._src.loop._pending import Pending
from jaxstep._src.step import Runtime


class LateBatch:
    """A batch the data thread was still pulling (inside ``next(batches)``) when fit
    stopped: it reaches :class:`Untrained` when ``next`` returns (or nothing does,
    when it raises or the data ended)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._sink: list[Any] | None = None
        self._batch: list[Any] = []  # the batch, once it arrived

    def arrive(self, batch: Any) -> None:
        """``next`` returned ``batch`` (the data thread calls it)."""
        with self._lock:
            self._batch.append(batch)
            if self._sink is not None:
                self._sink.append(batch)
        self._done.set()

    def cancel(self) -> None:
        """``next`` raised, or the data ended: no batch comes."""
        self._done.set()

    def into(self, sink: list[Any]) -> None:
        """The batch goes to the end of ``sink`` when it arrives (or now, if it has)."""
        with self._lock:
            self._sink = sink
            sink.extend(self._batch)

    @property
    def pending(self) -> bool:
        """Whether ``next`` has not returned yet."""
        return not self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for ``next`` to return; whether it has."""
        return self._done.wait(timeout)


class Untrained(list):
    """``err.batches``: the batches fit pulled and did not train, in the order pulled.
    When fit stopped while its data thread was inside ``next(batches)`` (a slow source,
    ``fit(prefetch=...)``), the batch that call returns is appended when it arrives:
    :attr:`pending` says whether one is still on its way, and iterating waits for it,
    so ``fit(step, err.state, itertools.chain(err.batches, rest))`` trains it too.
    It pickles as a plain list of the batches it holds."""

    def __init__(self, batches: Sequence[Any] = (), late: LateBatch | None = None):
        super().__init__(batches)
        self._late = late
        if late is not None:
            late.into(self)

    @property
    def pending(self) -> bool:
        """Whether a batch is still on its way (the data thread is inside ``next``)."""
        return self._late is not None and self._late.pending

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until no batch is on its way (``timeout`` seconds at most); whether none
        is."""
        return self._late is None or self._late.wait(timeout)

    def __iter__(self) -> Iterator[Any]:
        self.wait()
        return super().__iter__()

    def __reduce__(self) -> tuple[Any, ...]:
        return list, (list(self),)


def untrained_batches(
    left: Sequence[Pending | Item | None], pulled: int
) -> tuple[list[Any], Cursor | None]:
    """The batches of ``left`` (steps in flight, the batch in hand, the queue, the rows
    carried), in the order they were pulled, and where their rows are in the data
    (``pulled``: the batches the loop was handed; None: unknown, or none left): the
    first, and with rows of several shapes carried the later batches holding some
    (:func:`~jaxstep._src.loop._carry.untrained_at`)."""
    known = [u for u in left if u is not None]
    order = [u.item if isinstance(u, Pending) else u for u in known]
    items = [item for item in order if item is not None]
    if len(items) < len(order):
        return [given(u) for u in known], None
    where = [starts(item) for item in items]
    known = [u for _, u in sorted(zip(where, known, strict=True), key=lambda p: p[0][0])]
    if not known:
        return [], None
    return [given(u) for u in known], untrained_at([s for w in where for s in w], pulled)


def given(left: Pending | Item) -> Any:
    """The rows of a batch not trained as this process gave them: on several processes
    once rows were re-split (``Item.shared``), those it passed, not its devices'; every
    row when it read the batches whole (``fit(global_batches=True)``)."""
    item = left.item if isinstance(left, Pending) else left
    if item is not None and item.shared is not None:
        return item.shared.given()
    return left.batch


def last_good(runtime: Runtime, state: TrainState, failed: str | None) -> TrainState | None:
    """The state an exception leaving fit hands back: ``state``, its halt cleared when
    a step still in flight failed (``failed``), or None when it was donated (a second
    Ctrl-C inside a dispatch)."""
    try:
        validate.alive(state)
        return state if failed is None else runtime.clear_halt(state)
    except ValueError:
        return None


def attach(
    err: BaseException,
    state: TrainState | None,
    untrained: Untrained,
    failed: str | None,
    saved: str | None,
) -> None:
    """``err.state``, ``err.batches`` and a note saying where they are."""
    try:
        err.state = state  # type: ignore[attr-defined]
        err.batches = untrained  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes
        return
    if state is None:
        lines = [
            "jaxstep: the state was lost (a second Ctrl-C stopped a step while it held "
            "the state); restore the latest checkpoint"
        ]
    else:
        lines = ["jaxstep: the last good state is in error.state"]
    count = len(untrained)
    lines.append(
        f"error.batches holds the {count} batch(es) pulled and not trained, in order: "
        "fit(step, error.state, itertools.chain(error.batches, rest)) loses nothing"
        if count or untrained.pending
        else "every batch pulled was trained (error.batches is empty)"
    )
    if untrained.pending:
        lines.append(
            "one more batch is on its way: fit's data thread was inside next(batches) "
            "when it stopped; the batch it returns goes to the end of error.batches "
            "(error.batches.pending until then; iterating error.batches waits for it)"
        )
    if failed is not None:
        lines.append(failed)
    if saved is not None:
        lines.append(f"the state was saved to {saved}: fit(..., resume=True) goes on from it")
    err.add_note("; ".join(lines))


@contextlib.contextmanager
def deferred_interrupts(mark: Callable[[], None]) -> Iterator[None]:
    """A first Ctrl-C (SIGINT) only calls ``mark`` (the loop's ``interrupt``: its
    ``advance`` raises ``KeyboardInterrupt`` once the step in flight is dispatched and
    the one before it settled, so no state is caught half donated). A second one raises
    at once. Only in the main thread, and only over Python's own handler (a notebook
    kernel's or the user's handler is left alone)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    marked = False

    def first(signum: int, frame: Any) -> None:
        nonlocal marked
        if marked:
            raise KeyboardInterrupt
        marked = True
        mark()
        print(
            "jaxstep: stopping after the step in flight (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

"""The data position: :func:`jaxstep.fit` pulls its batches through a :class:`Source`
that counts them, so a checkpoint records which batch comes next and a resume starts
exactly there.

``batches`` may be, from the most to the least exact on resume:

- a callable ``start -> iterable``: fit asks for the batches from the data position;
- a checkpointable iterator (``get_state()`` / ``set_state(state)``, e.g. the iterator
  of a ``grain.DataLoader``), or an iterable whose iterator is one: its state is saved
  before the next batch and set again on resume;
- a sequence (a list of batches): resumed by index;
- any other iterable: it works, but a resume takes batches from wherever the iterator
  stands (a one-time warning says so when checkpointing).
"""

from __future__ import annotations

import base64
import collections.abc
import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import Final
from typing import NamedTuple
from typing import cast

from jaxstep._src.core import SourceKind
from jaxstep._src.core import warn

CALLABLE: Final = "callable"
CHECKPOINTABLE: Final = "checkpointable"
SEQUENCE: Final = "sequence"
ITERATOR: Final = "iterator"
#: kinds whose resume is exact
EXACT: tuple[SourceKind, ...] = (CALLABLE, CHECKPOINTABLE, SEQUENCE)

_warned_plain = False


class Cursor(NamedTuple):
    """A place in the data one fit call pulls: before the source's ``batch``-th batch
    (counted in this source, from 0), ``rows`` rows into it; ``then``: the later batches
    that hold rows not trained, when some between were trained (see
    :attr:`Position.then`; counted in this source too). :meth:`Source.position` turns it
    into the :class:`Position` a checkpoint saves."""

    batch: int
    rows: int = 0
    then: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the data stands before a batch.

    Attributes:
      index: batches that came before it, counted from the start of the data.
      kind: how the source resumes (``callable``, ``checkpointable``, ``sequence``,
        ``iterator``).
      iterator_state: a checkpointable iterator's ``get_state()`` before that batch.
      rows: rows of that batch trained already (a run that lost a device carries rows
        from batch to batch, ``jaxstep._src.loop._carry``): a resume passes over them.
      carried: the run that saved it carried rows (a device had left it): a resume
        carries them too, even from a batch's first row (its batches need not divide
        by the devices left).
      then: rows carried of several shapes (bucketed lengths, each carried until a batch
        of its own shape comes): the batches after ``index`` that still hold rows not
        trained, each as ``(index, first row not trained)``, in order, when batches
        between were trained. A resume passes over every batch between two of them (and
        between ``index`` and the first) and over the rows before each one's row; the
        batches after the last are whole. Empty: every batch after ``index`` is whole.
    """

    index: int
    kind: SourceKind
    iterator_state: Any = None
    rows: int = 0
    carried: bool = False
    then: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        state = self.iterator_state
        if isinstance(state, bytes):  # grain's iterators return JSON as bytes
            state = {"base64": base64.b64encode(state).decode("ascii")}
        return {
            "index": self.index,
            "kind": self.kind,
            "iterator_state": state,
            "rows": self.rows,
            "carried": self.carried,
            "then": [list(pair) for pair in self.then],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Position:
        state = data.get("iterator_state")
        if isinstance(state, dict) and set(state) == {"base64"}:
            state = base64.b64decode(state["base64"])
        kind = cast(SourceKind, str(data["kind"]))  # as saved: one of SourceKind's
        rows, carried = int(data.get("rows", 0)), bool(data.get("carried", False))
        then = tuple((int(b), int(r)) for b, r in data.get("then", ()))
        return cls(int(data["index"]), kind, state, rows, carried, then)


def _checkpointable(obj: Any) -> bool:
    return callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))


class Source(Iterator[Any]):
    """An iterator over ``fit``'s batches that knows its data position.

    Args:
      batches: see the module docstring.
      start: the position of the first batch to pull. For a callable it is passed
        as ``batches(start.index)``; a checkpointable iterator is set to
        ``start.iterator_state``; a sequence is indexed from ``start.index``.
      resuming: ``start`` comes from a checkpoint; a source that yields nothing
        there is then an error (the data is shorter than the run that saved it).
      checkpointing: warn (once) when ``batches`` cannot resume exactly.
      lookahead: batches pulled ahead of the one trained (``fit(prefetch=...)``): the
        data positions of that many more are kept.
    """

    def __init__(
        self,
        batches: Any,
        start: Position | int = 0,
        *,
        resuming: bool = False,
        checkpointing: bool = False,
        lookahead: int = 0,
    ):
        if isinstance(start, int):
            start = Position(start, "")
        self.start = start.index
        #: where the rows not trained begin, counted in this source: rows of the first
        #: batch trained already, later batches with rows not trained (Position.then)
        later = tuple((index - start.index, rows) for index, rows in start.then)
        self.resumed = Cursor(0, start.rows, later)
        #: rows are carried from batch to batch (a device left this run, or the run
        #: that saved ``start``): the positions saved say so
        self.carrying = start.carried
        self.count = 0  # batches pulled through this source
        #: ``start`` comes from a checkpoint (a resumed run)
        self.resuming = resuming
        self._resuming = resuming and start.index > 0
        self._marks: dict[int, Any] = {}
        #: the oldest batch a position may still name (rows carried: :meth:`hold`)
        self._held: int | None = None
        #: marks kept before the newest batch pulled: a checkpoint is saved a step or
        #: two after its mark, and fit's prefetch pulls ``lookahead`` batches ahead
        self.margin = 4 + (lookahead + 1 if lookahead else 0)
        self._watch: Callable[[int], bool] | None = None
        self.kind: SourceKind
        if is_callable_source(batches):
            self.kind = CALLABLE
            self._it = iter(batches(start.index))
        elif isinstance(batches, collections.abc.Sequence) and not isinstance(batches, str):
            self.kind = SEQUENCE
            if start.index > len(batches):
                raise ValueError(
                    f"the data position {start.index} is past the end of batches, which "
                    f"holds {len(batches)} batches: resume with the data the checkpoint was "
                    "made with (or a longer one), or start over (resume=False)"
                )
            self._it = itertools.islice(batches, start.index, None)
        else:
            if not _iterable(batches):
                raise TypeError(
                    f"batches must be an iterable of batches or a callable start -> "
                    f"iterable, got {type(batches).__name__}"
                )
            self._it = batches if _checkpointable(batches) else iter(batches)
            self.kind = CHECKPOINTABLE if _checkpointable(self._it) else ITERATOR
            if self.kind == CHECKPOINTABLE and start.iterator_state is not None:
                self._it.set_state(start.iterator_state)
            elif self.kind == CHECKPOINTABLE and resuming and start.index > 0:
                warn(
                    f"resuming at data position {start.index}, but the checkpoint holds no "
                    "iterator state (it was made with another kind of batches): the "
                    "iterator goes on from wherever it stands",
                )
        if self.kind == ITERATOR and resuming and start.index > 0:
            warn(
                f"resuming at data position {start.index} with a plain iterator: its "
                "batches are taken from wherever it stands, not from that position. For an "
                "exact resume pass a callable start -> iterable, a sequence, or a "
                "checkpointable iterator (e.g. a grain.DataLoader's)",
            )
        elif self.kind == ITERATOR and checkpointing:
            _warn_plain_once()

    @property
    def exact(self) -> bool:
        """Whether a checkpoint of this source resumes at exactly the next batch."""
        return self.kind in EXACT

    def watch(self, before: Callable[[int], bool]) -> None:
        """Record the iterator's state before pulling batch ``count`` (counted in this
        source) whenever ``before(count)``: cheap for the other batches."""
        self._watch = before if self.kind == CHECKPOINTABLE else None

    def hold(self, count: int | None) -> None:
        """Rows of batch ``count`` are still carried (None: none): the iterator's state
        before it is kept, however far behind, so a position there resumes exactly."""
        self._held = count

    def position(self, at: Cursor | None = None) -> Position:
        """The position of ``at`` (default: before the next batch)."""
        count, rows, then = (self.count, 0, ()) if at is None else at
        state = self._marks.get(count)
        if state is None and self.kind == CHECKPOINTABLE and count == self.count:
            state = self._it.get_state()
        later = tuple((self.start + b, r) for b, r in then)
        return Position(self.start + count, self.kind, state, rows, self.carrying, later)

    def __next__(self) -> Any:
        if self._watch is not None and self._watch(self.count):
            # Keep the last few marks: a checkpoint is saved a step or two after its mark
            # (and those from the oldest batch whose rows are still carried).
            oldest = self.count - self.margin
            if self._held is not None:
                oldest = min(oldest, self._held)
            self._marks = {k: v for k, v in self._marks.items() if k >= oldest}
            self._marks[self.count] = self._it.get_state()
        try:
            batch = next(self._it)
        except StopIteration:
            if self._resuming and self.count == 0:
                raise ValueError(
                    f"the data position {self.start} is past the end of batches: it "
                    f"yielded no batch from there. Resume with the data the checkpoint "
                    "was made with (or a longer one), or start over (resume=False)"
                ) from None
            raise
        self.count += 1
        return batch


def is_callable_source(batches: Any) -> bool:
    """Whether ``batches`` is a callable ``start -> iterable`` (not itself iterable)."""
    return callable(batches) and not _checkpointable(batches) and not _iterable(batches)


def _iterable(obj: Any) -> bool:
    return hasattr(obj, "__iter__") or hasattr(obj, "__next__")


def _warn_plain_once() -> None:
    global _warned_plain
    if not _warned_plain:
        _warned_plain = True
        warn(
            "checkpointing with a plain iterator of batches: a checkpoint records how many "
            "batches were used, but resuming cannot skip to that position. For an exact "
            "resume pass a callable start -> iterable, a sequence, or a checkpointable "
            "iterator (e.g. a grain.DataLoader's)",
        )

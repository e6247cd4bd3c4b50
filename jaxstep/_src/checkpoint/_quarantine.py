"""The quarantine file: the examples ``fit(..., recover=...)`` found bad, for a data
pipeline to filter next epoch.

``<checkpoint_dir>/quarantine.jsonl`` holds one JSON object per line, appended as each
data failure is recovered (only process 0 writes; the lines never change once written)::

    {"step": 5, "batch": 5, "examples": [40], "rows": [325], "batch_size": 64,
     "device_ids": [3], "time": 1764770000.0, "fit_start": 0,
     "example_id": "id", "ids": [48213]}

- ``batch``: the batch of the failing step, counting the first batch the fit call was
  given as 0 (the data position ``fit`` resumes from, so the same number on resume;
  for a callable source, ``state.step`` at the fit call's start);
- ``examples``: the offending examples, as indices into that global batch;
- ``rows``: the same examples in the stream of examples, ``batch * batch_size +
  example`` (for batches of a constant size);
- ``device_ids``: the devices whose chunks held them; ``step``: ``state.step`` then;
- ``fit_start``: ``state.step`` when the fit call that wrote the line started: the
  lines of one fit call (one epoch of an epoch loop) share it, and ``(fit_start,
  batch)`` tells apart the batches of two epochs that both count from 0;
- with ``Recover(example_id=...)``: ``example_id``, the batch leaf named, and ``ids``,
  its values for ``examples`` (in their order): what names the examples in the data
  whatever the order of the batches, shuffled or not.

Lines written before ``fit_start`` and ``ids`` existed read the same way (they have
neither: no ids).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

FILE = "quarantine.jsonl"


def append_quarantine(
    directory: str | os.PathLike[str],
    *,
    step: int,
    batch: int,
    examples: Sequence[int],
    batch_size: int,
    device_ids: Sequence[int],
    fit_start: int | None = None,
    example_id: str | None = None,
    ids: Sequence[int] = (),
) -> Path | None:
    """Appends one line to ``directory``'s quarantine file (process 0 only); returns
    the file's path (None on the other processes). ``ids``: the ``example_id`` leaf's
    values for ``examples``, in their order (with ``example_id`` only)."""
    if jax.process_index() != 0:
        return None
    path = Path(directory) / FILE
    line: dict[str, Any] = {
        "step": int(step),
        "batch": int(batch),
        "examples": [int(e) for e in examples],
        "rows": [int(batch) * int(batch_size) + int(e) for e in examples],
        "batch_size": int(batch_size),
        "device_ids": [int(d) for d in device_ids],
        "time": time.time(),
    }
    if fit_start is not None:
        line["fit_start"] = int(fit_start)
    if example_id is not None:
        line.update(example_id=example_id, ids=[int(i) for i in ids])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


class Quarantine(dict[int, tuple[int, ...]]):
    """What :func:`read_quarantine` returns: ``{batch: examples}`` (a dict, as before
    ids existed), and what else the lines hold.

    Attributes:
      ids: the example ids recorded (``Recover(example_id=...)``), of every line: what a
        data pipeline filters on when the data is shuffled (a frozenset; empty when no
        line has ids).
      lines: every line as written (dicts, in the order appended): ``fit_start`` tells
        the fit calls (epochs) apart.
    """

    ids: frozenset[int]
    lines: tuple[dict[str, Any], ...]

    def __init__(self, lines: Sequence[dict[str, Any]] = ()):
        found: dict[int, set[int]] = {}
        for line in lines:
            found.setdefault(int(line["batch"]), set()).update(int(e) for e in line["examples"])
        super().__init__((b, tuple(sorted(e))) for b, e in sorted(found.items()))
        self.ids = frozenset(int(i) for line in lines for i in line.get("ids", ()))
        self.lines = tuple(lines)

    def __repr__(self) -> str:
        extra = f", ids={sorted(self.ids)}" if self.ids else ""
        return f"Quarantine({dict(self)!r}{extra})"


def read_quarantine(directory: str | os.PathLike[str]) -> Quarantine:
    """The examples quarantined by ``fit(..., recover=jaxstep.Recover(), checkpoint_dir=
    directory)``, read from the directory's ``quarantine.jsonl``. A line cut short by a
    crash is passed over.

    Args:
      directory: the ``checkpoint_dir`` the fit calls were given.

    Returns:
      ``{batch: examples}`` (a dict): the batch counted from the first a fit call was
      given (0) and the examples as indices into it, sorted, the lines of every fit
      call together; empty when nothing was quarantined (or there is no file). Its
      ``.ids`` are the example ids recorded with ``Recover(example_id=...)`` (a
      frozenset), its ``.lines`` each line as written.

    Raises:
      OSError: the file exists but cannot be read.

    Example:
      A NaN in example 4 of batch 1 is quarantined, and the run goes on:

      >>> import tempfile, jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("input", device_id=2, step=1, mode="data")])
      >>> checkpoint_dir = tempfile.mkdtemp()
      >>> state = jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3),
      ...                     recover=jaxstep.Recover(), checkpoint_dir=checkpoint_dir)
      >>> dict(jaxstep.read_quarantine(checkpoint_dir))  # {batch: its examples}
      {1: (4,)}

      The batches come in the same order every epoch: skip the examples by position::

          bad = jaxstep.read_quarantine(checkpoint_dir)
          def clean(i, batch):
              keep = np.setdiff1d(np.arange(len(batch["x"])), bad.get(i, ()))
              return {k: v[keep] for k, v in batch.items()}

      Shuffled data: by id (each example carries its id in ``batch["id"]``, and ``fit``
      was given ``recover=jaxstep.Recover(example_id="id")``)::

          bad = jaxstep.read_quarantine(checkpoint_dir).ids
          records = [r for r in records if r["id"] not in bad]  # or a grain Filter
    """
    path = Path(directory) / FILE
    if not path.exists():
        return Quarantine()
    lines = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and "batch" in line and "examples" in line:
            lines.append(line)
    return Quarantine(lines)

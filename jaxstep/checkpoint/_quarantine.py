"""The quarantine file: the examples ``fit(..., recover=...)`` found bad, for a data
pipeline to filter next epoch.

``<checkpoint_dir>/quarantine.jsonl`` holds one JSON object per line, appended as each
data failure is recovered (only process 0 writes; the lines never change once written)::

    {"step": 5, "batch": 5, "examples": [40], "rows": [325], "batch_size": 64,
     "device_ids": [3], "time": 1764770000.0}

- ``batch``: the batch of the failing step, counting the data's first batch as 0 (the
  data position ``fit`` resumes from, so the same number on resume);
- ``examples``: the offending examples, as indices into that global batch;
- ``rows``: the same examples in the stream of examples, ``batch * batch_size +
  example`` (for batches of a constant size);
- ``device_ids``: the devices whose chunks held them; ``step``: ``state.step`` then.

:func:`read_quarantine` reads the file back as ``{batch: examples}``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

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
) -> Path | None:
    """Appends one line to ``directory``'s quarantine file (process 0 only); returns
    the file's path (None on the other processes)."""
    if jax.process_index() != 0:
        return None
    path = Path(directory) / FILE
    line = {
        "step": int(step),
        "batch": int(batch),
        "examples": [int(e) for e in examples],
        "rows": [int(batch) * int(batch_size) + int(e) for e in examples],
        "batch_size": int(batch_size),
        "device_ids": [int(d) for d in device_ids],
        "time": time.time(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


def read_quarantine(directory: str | os.PathLike[str]) -> dict[int, tuple[int, ...]]:
    """The examples quarantined by ``fit(..., recover=jaxstep.Recover(), checkpoint_dir=
    directory)``: ``{batch: examples}``, the batch counted from the data's first (0) and
    the examples as indices into it, sorted; ``{}`` when nothing was quarantined.

    A line cut short by a crash is passed over.

    Example: skip them next epoch::

        bad = jaxstep.read_quarantine(checkpoint_dir)
        def clean(i, batch):
            keep = np.setdiff1d(np.arange(len(batch["x"])), bad.get(i, ()))
            return {k: v[keep] for k, v in batch.items()}
    """
    path = Path(directory) / FILE
    if not path.exists():
        return {}
    found: dict[int, set[int]] = {}
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        found.setdefault(int(line["batch"]), set()).update(int(e) for e in line["examples"])
    return {b: tuple(sorted(e)) for b, e in sorted(found.items())}

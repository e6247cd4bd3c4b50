"""``fit``'s checkpoint options, checked once when built: each wrong value gets an error
naming it and the fix, before anything runs (docs/checkpoints.md)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from jaxstep._src.checkpoint._store import as_path


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """How one :func:`jaxstep.fit` call checkpoints (its keywords of the same names).

    Attributes:
      checkpoint_dir: where the checkpoints and, on a failure, the emergency save go
        (created if missing; None: nowhere).
      checkpoint_every: save every this many steps, once the step's replica check passed
        (None: only the emergency saves and the save of an early stop).
      keep: how many periodic checkpoints to keep (None: all).
      resume: go on from the latest verified checkpoint of ``checkpoint_dir``.
    """

    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | None = None
    keep: int | None = 3
    resume: bool = False

    def __post_init__(self) -> None:
        every, directory, keep = self.checkpoint_every, self.checkpoint_dir, self.keep
        if every is not None:
            if _not_count(every, 1):
                raise ValueError(f"checkpoint_every must be an int >= 1 or None, got {every!r}")
            if directory is None:
                raise ValueError(f"checkpoint_every={every} needs checkpoint_dir=... to write to")
        if keep is not None and _not_count(keep, 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if self.resume and directory is None:
            raise ValueError("resume=True needs checkpoint_dir=... to resume from")
        if directory is not None:
            _check_directory(directory)


def _not_count(value: Any, least: int) -> bool:
    """Whether ``value`` is not an int >= ``least`` (a bool is no count)."""
    return isinstance(value, bool) or not isinstance(value, int) or value < least


def _check_directory(directory: str | os.PathLike[str]) -> None:
    """A local checkpoint_dir must be (or become) a writable directory: a checkpoint
    write that fails only logs, so a run would otherwise end with no checkpoint."""
    path = as_path(directory)
    if not isinstance(path, Path):
        return  # a URL (gs://...): orbax reports its own errors
    shown = repr(str(directory))
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir {shown} is a file; pass a directory (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"checkpoint_dir {shown} cannot be created ({err.strerror}: {err.filename}); "
            "pass a directory you can write to"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"checkpoint_dir {shown} is not writable; pass a directory you can write to"
        )

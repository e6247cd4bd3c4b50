"""Checkpoints that lose nothing: the orbax store, the saved layout, the data position,
the emergency save of a failure, and what several processes tell each other about
them (docs/checkpoints.md)."""

from jaxstep._src.checkpoint._emergency import Emergency as Emergency
from jaxstep._src.checkpoint._emergency import read_emergency as read_emergency
from jaxstep._src.checkpoint._options import CheckpointOptions as CheckpointOptions
from jaxstep._src.checkpoint._position import Cursor as Cursor
from jaxstep._src.checkpoint._quarantine import append_quarantine as append_quarantine
from jaxstep._src.checkpoint._quarantine import read_quarantine as read_quarantine
from jaxstep._src.checkpoint._resume import begin_fit as begin_fit
from jaxstep._src.checkpoint._save import save as save
from jaxstep._src.checkpoint._saver import Saver as Saver
from jaxstep._src.checkpoint._store import Store as Store
from jaxstep._src.checkpoint._store import restore as restore
from jaxstep._src.checkpoint._store import restore_on as restore_on

__all__ = [
    "CheckpointOptions",
    "Cursor",
    "Emergency",
    "Saver",
    "Store",
    "append_quarantine",
    "begin_fit",
    "read_emergency",
    "read_quarantine",
    "restore",
    "restore_on",
    "save",
]

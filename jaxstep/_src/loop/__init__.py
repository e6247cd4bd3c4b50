"""The training loop: :func:`fit` (dispatch step t, settle step t-1), a short driver
over :class:`Loop`'s named steps and its actions (checkpoints, the step watchdog that
names a hung device, recovery, the carry, the callbacks, the replay diagnosis); the
:class:`History` it keeps, :class:`Callback` (the one protocol its listeners follow),
and the replay diagnosis of a failed step."""

from jaxstep._src.loop._callbacks import Callback as Callback
from jaxstep._src.loop._diagnose import Diagnosis as Diagnosis
from jaxstep._src.loop._diagnose import diagnose as diagnose
from jaxstep._src.loop._driver import Loop as Loop
from jaxstep._src.loop._failure import replica_state as replica_state
from jaxstep._src.loop._fit import fit as fit
from jaxstep._src.loop._goodput import Goodput as Goodput
from jaxstep._src.loop._goodput import timeline as timeline
from jaxstep._src.loop._history import Entry as Entry
from jaxstep._src.loop._history import History as History
from jaxstep._src.loop._options import FitOptions as FitOptions
from jaxstep._src.loop._options import Recover as Recover
from jaxstep._src.loop._pending import Item as Item
from jaxstep._src.loop._pending import Pending as Pending
from jaxstep._src.loop._records import Recovery as Recovery

__all__ = [
    "Callback",
    "Diagnosis",
    "Entry",
    "FitOptions",
    "Goodput",
    "History",
    "Item",
    "Loop",
    "Pending",
    "Recover",
    "Recovery",
    "diagnose",
    "fit",
    "replica_state",
    "timeline",
]

"""The training loop: :func:`fit` (dispatch step t, settle step t-1), the
:class:`History` it keeps, the step watchdog that names a hung device, and the replay
diagnosis of a failed step."""

from jaxstep.loop._diagnose import Diagnosis as Diagnosis
from jaxstep.loop._diagnose import diagnose as diagnose
from jaxstep.loop._fit import fit as fit
from jaxstep.loop._fit import replica_state as replica_state
from jaxstep.loop._history import History as History

__all__ = ["Diagnosis", "History", "diagnose", "fit", "replica_state"]

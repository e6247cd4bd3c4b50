"""The vocabulary every layer speaks: the training state, the health table and its
status flags, the error, the processes of a run, argument validation, and the types the
layers share (pytrees, the modes: ``BackendName``, ``Policy``, ``Verdict``, ...). Imports
nothing else of jaxstep."""

from jaxstep._src.core._causes import CAUSES as CAUSES
from jaxstep._src.core._errors import TrainingWorkerError as TrainingWorkerError
from jaxstep._src.core._failures import Failure as Failure
from jaxstep._src.core._failures import failed_alike as failed_alike
from jaxstep._src.core._failures import failures_from_table as failures_from_table
from jaxstep._src.core._restart import ENV_RESTART as ENV_RESTART
from jaxstep._src.core._restart import RESTART_EXIT_CODE as RESTART_EXIT_CODE
from jaxstep._src.core._restart import under_restarting_launcher as under_restarting_launcher
from jaxstep._src.core._speech import log as log
from jaxstep._src.core._speech import warn as warn
from jaxstep._src.core._state import HostKey as HostKey
from jaxstep._src.core._state import LossScaleState as LossScaleState
from jaxstep._src.core._state import StepInfo as StepInfo
from jaxstep._src.core._state import StepOutput as StepOutput
from jaxstep._src.core._state import TrainState as TrainState
from jaxstep._src.core._state import from_host as from_host
from jaxstep._src.core._state import to_host as to_host
from jaxstep._src.core._types import BACKEND_NAMES as BACKEND_NAMES
from jaxstep._src.core._types import POLICIES as POLICIES
from jaxstep._src.core._types import SHARD_STATES as SHARD_STATES
from jaxstep._src.core._types import BackendName as BackendName
from jaxstep._src.core._types import Batch as Batch
from jaxstep._src.core._types import FaultKind as FaultKind
from jaxstep._src.core._types import FaultMode as FaultMode
from jaxstep._src.core._types import Params as Params
from jaxstep._src.core._types import Policy as Policy
from jaxstep._src.core._types import PyTree as PyTree
from jaxstep._src.core._types import RecoveryAction as RecoveryAction
from jaxstep._src.core._types import ReplayVerdict as ReplayVerdict
from jaxstep._src.core._types import ShardState as ShardState
from jaxstep._src.core._types import SourceKind as SourceKind
from jaxstep._src.core._types import Verdict as Verdict
from jaxstep._src.core._weighted import WeightedLoss as WeightedLoss
from jaxstep._src.core.health import COL as COL
from jaxstep._src.core.health import COLUMNS as COLUMNS
from jaxstep._src.core.health import HealthTable as HealthTable
from jaxstep._src.core.health import Status as Status

__all__ = [
    "BACKEND_NAMES",
    "BackendName",
    "Batch",
    "CAUSES",
    "COL",
    "COLUMNS",
    "ENV_RESTART",
    "Failure",
    "FaultKind",
    "FaultMode",
    "HealthTable",
    "HostKey",
    "LossScaleState",
    "POLICIES",
    "Params",
    "Policy",
    "PyTree",
    "RESTART_EXIT_CODE",
    "RecoveryAction",
    "ReplayVerdict",
    "SHARD_STATES",
    "ShardState",
    "SourceKind",
    "Status",
    "StepInfo",
    "StepOutput",
    "TrainState",
    "TrainingWorkerError",
    "Verdict",
    "WeightedLoss",
    "failed_alike",
    "failures_from_table",
    "from_host",
    "log",
    "to_host",
    "under_restarting_launcher",
    "warn",
]

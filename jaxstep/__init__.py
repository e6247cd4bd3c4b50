"""jaxstep: data-parallel training in JAX that says which device failed, and why."""

import importlib
from typing import Any

from jaxstep import distributed
from jaxstep import plot
from jaxstep import testing
from jaxstep.build import make_train_step
from jaxstep.checkpoint import restore
from jaxstep.diagnose import Diagnosis
from jaxstep.diagnose import diagnose
from jaxstep.errors import Failure
from jaxstep.errors import TrainingWorkerError
from jaxstep.health import HealthTable
from jaxstep.health import Status
from jaxstep.history import History
from jaxstep.loop import fit
from jaxstep.loop import replica_state
from jaxstep.metrics import JsonlWriter
from jaxstep.metrics import TensorBoardWriter
from jaxstep.monitors import LossSpike
from jaxstep.progress import Progress
from jaxstep.scaling import DynamicLossScale
from jaxstep.state import StepOutput
from jaxstep.state import TrainState
from jaxstep.step import TrainStep

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # jaxstep.flax (the Flax adapters) loads flax.nnx: only when first used.
    if name == "flax":
        return importlib.import_module("jaxstep.flax")
    raise AttributeError(f"module 'jaxstep' has no attribute {name!r}")


__all__ = [
    "Diagnosis",
    "DynamicLossScale",
    "Failure",
    "HealthTable",
    "History",
    "JsonlWriter",
    "LossSpike",
    "Progress",
    "Status",
    "StepOutput",
    "TensorBoardWriter",
    "TrainState",
    "TrainStep",
    "TrainingWorkerError",
    "diagnose",
    "distributed",
    "fit",
    "make_train_step",
    "plot",
    "replica_state",
    "restore",
    "testing",
]

"""jaxstep: data-parallel training in JAX that says which device failed, and why.

The public face: ``import jaxstep`` and nothing deeper. The layers behind it (data
flows down; nothing imports a layer above it; docs/internals.md):

    cli/          jaxstep demo, doctor
    testing/, flax.py, data.py
                  the users' kits: the testing kit, the Flax adapters, the digits
                  the demo and the notebooks train on (jaxstep.data)
    callbacks/, plot.py
                  progress, metric writers; pictures of a run (jaxstep.plot)
    loop/         fit, History, the watchdog, the replay diagnosis
    checkpoint/   the orbax store, the data position, the emergency save
    distributed/  jax.distributed runtime, heartbeats, reports, launcher
    step/         make_train_step, TrainStep: validate, place, dispatch, replay
    program/      the traced per-device program: checks, one all-reduce, verdict
    core/         the vocabulary: state, health, errors, processes, validation
"""

import importlib
from typing import Any

from jaxstep import distributed
from jaxstep import plot
from jaxstep import testing
from jaxstep.callbacks import CluWriter
from jaxstep.callbacks import JsonlWriter
from jaxstep.callbacks import Progress
from jaxstep.callbacks import TensorBoardWriter
from jaxstep.checkpoint import read_emergency
from jaxstep.checkpoint import read_quarantine
from jaxstep.checkpoint import restore
from jaxstep.core import RESTART_EXIT_CODE
from jaxstep.core import Failure
from jaxstep.core import HealthTable
from jaxstep.core import Status
from jaxstep.core import StepOutput
from jaxstep.core import TrainingWorkerError
from jaxstep.core import TrainState
from jaxstep.core import WeightedLoss
from jaxstep.loop import Diagnosis
from jaxstep.loop import History
from jaxstep.loop import Recover
from jaxstep.loop import Recovery
from jaxstep.loop import diagnose
from jaxstep.loop import fit
from jaxstep.loop import replica_state
from jaxstep.program import DynamicLossScale
from jaxstep.program import LossSpike
from jaxstep.step import TrainStep
from jaxstep.step import make_train_step

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # jaxstep.flax (the Flax adapters) loads flax.nnx: only when first used.
    if name == "flax":
        return importlib.import_module("jaxstep.flax")
    raise AttributeError(f"module 'jaxstep' has no attribute {name!r}")


__all__ = [
    "CluWriter",
    "Diagnosis",
    "DynamicLossScale",
    "Failure",
    "HealthTable",
    "History",
    "JsonlWriter",
    "LossSpike",
    "Progress",
    "RESTART_EXIT_CODE",
    "Recover",
    "Recovery",
    "Status",
    "StepOutput",
    "TensorBoardWriter",
    "TrainState",
    "TrainStep",
    "TrainingWorkerError",
    "WeightedLoss",
    "diagnose",
    "distributed",
    "fit",
    "make_train_step",
    "plot",
    "read_emergency",
    "read_quarantine",
    "replica_state",
    "restore",
    "testing",
]

"""jaxstep: data-parallel training in JAX that says which device failed, and why.

Each device checks its own input, loss and gradients before the gradient all-reduce;
a failure raises :class:`jaxstep.TrainingWorkerError` naming the device, the step, the
tensor and the cause, with the last good state intact.

    step = jaxstep.make_train_step(loss_fn, optax.adam(1e-3))
    state = jaxstep.fit(step, step.init(params), batches)

The public face is this module's ``__all__`` and the kits ``jaxstep.testing``,
``jaxstep.flax``, ``jaxstep.distributed``, ``jaxstep.plot`` and ``jaxstep.data``:
``import jaxstep`` and nothing deeper. The API reference lists every name
(``make docs``); how the package is built inside is docs/internals.md.
"""

import importlib
import importlib.metadata as _metadata
from typing import Any

from jaxstep import distributed
from jaxstep import plot
from jaxstep import testing
from jaxstep._src.callbacks import CluWriter
from jaxstep._src.callbacks import JsonlWriter
from jaxstep._src.callbacks import Progress
from jaxstep._src.callbacks import TensorBoardWriter
from jaxstep._src.checkpoint import read_emergency
from jaxstep._src.checkpoint import read_quarantine
from jaxstep._src.checkpoint import restore
from jaxstep._src.checkpoint import save
from jaxstep._src.core import RESTART_EXIT_CODE
from jaxstep._src.core import Failure
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import WeightedLoss
from jaxstep._src.loop import Callback
from jaxstep._src.loop import Diagnosis
from jaxstep._src.loop import Goodput
from jaxstep._src.loop import History
from jaxstep._src.loop import Recover
from jaxstep._src.loop import Recovery
from jaxstep._src.loop import diagnose
from jaxstep._src.loop import fit
from jaxstep._src.loop import replica_state
from jaxstep._src.program import MODEL_AXIS
from jaxstep._src.program import DynamicLossScale
from jaxstep._src.program import LossSpike
from jaxstep._src.step import TrainStep
from jaxstep._src.step import make_train_step

try:  # pyproject.toml holds the version; the installed metadata carries it here
    __version__ = _metadata.version("jaxstep")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    # jaxstep.flax (the Flax adapters) loads flax.nnx: only when first used.
    if name == "flax":
        return importlib.import_module("jaxstep.flax")
    raise AttributeError(f"module 'jaxstep' has no attribute {name!r}")


__all__ = [
    "Callback",
    "CluWriter",
    "Diagnosis",
    "DynamicLossScale",
    "Failure",
    "HealthTable",
    "Goodput",
    "History",
    "JsonlWriter",
    "LossSpike",
    "MODEL_AXIS",
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
    "save",
    "testing",
]

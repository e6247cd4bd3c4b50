"""The names the layers type with: pytrees (what a user's params and batches are) and
the modes a step is built with (``backend``, ``on_failure``) and those a run reports
(a recovery's verdict and action, a replay's verdict)."""

from __future__ import annotations

from typing import Any
from typing import Literal
from typing import TypeAlias
from typing import get_args

#: A pytree of arrays (JAX has no precise type for one).
PyTree: TypeAlias = Any
#: The model parameters: a pytree of float arrays.
Params: TypeAlias = PyTree
#: A batch (or one device's chunk of it): a pytree whose leaves share a leading axis.
Batch: TypeAlias = PyTree

#: ``make_train_step(backend=...)``.
BackendName: TypeAlias = Literal["shard_map", "pmap"]
#: ``make_train_step(on_failure=...)``.
Policy: TypeAlias = Literal["raise", "skip", "drop"]
#: ``Recovery.verdict``: what ``fit(..., recover=...)`` found a failure to be.
Verdict: TypeAlias = Literal["transient", "data", "device", "spike", "diverged"]
#: ``Recovery.action``: what it did about it (in the order a summary counts them).
RecoveryAction: TypeAlias = Literal["retried", "quarantined", "excluded", "rolled back", "repaired"]
#: ``Diagnosis.verdict``: what a replay of a failed step found.
ReplayVerdict: TypeAlias = Literal["data", "device", "transient", "inconclusive"]

BACKEND_NAMES: tuple[BackendName, ...] = get_args(BackendName)
POLICIES: tuple[Policy, ...] = get_args(Policy)

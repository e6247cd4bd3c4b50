"""The names the layers type with: pytrees (what a user's params and batches are), the
modes a step is built with (``backend``, ``on_failure``), an injected fault's kind and
mode, how a data source resumes, and what a run reports (a recovery's verdict and
action, a replay's verdict)."""

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
#: ``make_train_step(shard_state=...)``: what is sharded over the devices (None: nothing).
ShardState: TypeAlias = Literal["optimizer", "params"]
#: ``make_train_step(on_failure=...)``.
Policy: TypeAlias = Literal["raise", "skip", "drop"]
#: ``Fault(kind=...)``: where an injected fault strikes.
FaultKind: TypeAlias = Literal["input", "loss", "grad", "param", "stall"]
#: ``Fault(mode=...)``: what an injected fault follows: the chip, one execution, a record.
FaultMode: TypeAlias = Literal["device", "transient", "data"]
#: ``Position.kind``: how ``fit``'s batches resume; ``""`` for a start given as a batch
#: number, before a source knows its kind.
SourceKind: TypeAlias = Literal["callable", "checkpointable", "sequence", "iterator", ""]
#: ``Recovery.verdict``: what ``fit(..., recover=...)`` found a failure to be.
Verdict: TypeAlias = Literal["transient", "data", "device", "spike", "diverged"]
#: ``Recovery.action``: what it did about it (in the order a summary counts them).
RecoveryAction: TypeAlias = Literal["retried", "quarantined", "excluded", "rolled back", "repaired"]
#: ``Diagnosis.verdict``: what a replay of a failed step found (``"diverged"``: a
#: replica's copy differs; nothing replayed, and not a verdict on the chip).
ReplayVerdict: TypeAlias = Literal["data", "device", "transient", "inconclusive", "diverged"]

BACKEND_NAMES: tuple[BackendName, ...] = get_args(BackendName)
POLICIES: tuple[Policy, ...] = get_args(Policy)
SHARD_STATES: tuple[ShardState, ...] = get_args(ShardState)

"""What a failed step's error says: its failures from the health table, the last good
state (rebuilt from a healthy replica when one diverged) and a note on how good it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core import CAUSES
from jaxstep._src.core import Failure
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import TrainState
from jaxstep._src.core import failed_alike
from jaxstep._src.loop._history import History
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of


def failure_error(
    runtime: Runtime, table: HealthTable, rows: int, current: TrainState, history: History
) -> TrainingWorkerError:
    """The error of a failed step from its health table; ``error.state`` the last good
    state (from ``current``, the halted state as it stands), and a note on how good it
    is. ``rows``: rows per device of the failing batch, as this process passed it.

    ``current`` is donated (its buffers become ``error.state``'s, ``halted`` cleared:
    no copy), unless a replica diverged and a healthy copy was read from it: the
    caller goes on with ``error.state``."""
    failures = runtime.failures(table, rows)
    alike = failed_alike(failures, len(runtime.devices))
    note = hint = None
    good = majority_position(runtime, failures)
    # a block only the diverged model group holds: no majority copy can rebuild it
    lone = _lone_blocks(runtime, current, failures) if good is not None else []
    if lone:
        good = None
    if good is not None:
        state = replica_state_on(runtime, current, good)
        note = (
            f"error.state was rebuilt from the copy on device {runtime.devices[good].id}, "
            "which agrees with the majority"
        )
    elif any(f.status & Status.DIVERGED for f in failures):
        # No copy can be called good: error.state holds the copy that differs (one of
        # the pair, or every copy), and resuming from it fails again at once.
        failures = failures if lone else _without_majority(runtime, failures)
        return TrainingWorkerError(
            failures,
            state=runtime.unhalted(current),
            note=_no_majority(runtime, failures, lone),
            history=history,
            state_is_good=False,
            alike=alike,
            hint=NO_MAJORITY_HINT,
        )
    else:
        state = runtime.unhalted(current)
        repeated = _repeated_drops(runtime, table)
        if repeated:
            # a device left out max_consecutive_drops steps in a row leads the error
            failures = [f for f in failures if f.device_id in repeated] + [
                f for f in failures if f.device_id not in repeated
            ]
            limit = runtime.options.max_consecutive_drops
            note = (
                f"device {failures[0].device_id} failed {limit} steps in a row "
                f"(max_consecutive_drops={limit}), each time on other rows; its chunks were "
                "left out of the mean until then"
            )
            hint = (
                "failing step after step, on other rows each time, is more often the "
                "device's own fault than bad data: suspect the chip. A replay tells which "
                "(fit(..., diagnose=True), or jaxstep.diagnose(step, error, batch) on "
                "error.batches[0]); to train without it, pass make_train_step(devices=[...]) "
                "without it, or fit(..., recover=jaxstep.Recover()), which excludes it. If the "
                "replay says data, check rows {rows} of the global batch"
            )
        elif runtime.options.on_failure in ("skip", "drop"):
            note = (
                f"{table.consecutive_skips + 1} failed steps in a row "
                f"(max_consecutive_skips={runtime.options.max_consecutive_skips})"
            )
        # Without verify_update an overflowing update is committed, and what fails
        # later fails because of it: say so rather than call this state good.
        if not runtime.options.verify_update and not _params_finite(state.params):
            note = (
                "the parameters in error.state are already non-finite: an earlier update "
                "overflowed (from finite gradients), and this failure follows from it. "
                "make_train_step(verify_update=True) stops such an update before it is "
                "committed"
            )
            return TrainingWorkerError(
                failures,
                state=state,
                note=note,
                history=history,
                state_is_good=False,
                alike=alike,
            )
    return TrainingWorkerError(
        failures, state=state, note=note, history=history, alike=alike, hint=hint
    )


NO_MAJORITY_HINT = (
    "of copies that differ with no majority none can be trusted: go back to the latest "
    "verified checkpoint (fit(..., checkpoint_dir=..., resume=True), or "
    "fit(recover=jaxstep.Recover()), which rolls back itself when it holds the batches "
    "since the checkpoint), or build the step with replicas >= 3 for a majority to "
    "repair from; if the same devices differ again, suspect their chips"
)


def _pair(runtime: Runtime, diverged: Sequence[Failure]) -> bool:
    """Whether ``diverged`` are the two copies of a pair: twins (``replicas=2``) or
    the two devices of a step on two."""
    two = runtime.options.replicas == 2 or len(runtime.devices) == 2
    return two and len(diverged) == 2


def _without_majority(runtime: Runtime, failures: Sequence[Failure]) -> list[Failure]:
    """``failures`` whose reason no longer says a majority was diverged from: a pair
    that differs names the other device, every copy differing says so."""
    diverged = [f for f in failures if f.status & Status.DIVERGED]
    words = dict(CAUSES)[Status.DIVERGED]
    out = []
    for f in failures:
        if not f.status & Status.DIVERGED:
            out.append(f)
            continue
        if _pair(runtime, diverged):
            other = next(d.device_id for d in diverged if d is not f)
            said = (
                f"copy differs from its twin's on device {other} (no majority: either may be bad)"
            )
        else:
            said = "copies differ with no majority agreeing"
        out.append(dataclasses.replace(f, reason=f.reason.replace(words, said, 1)))
    return out


def _no_majority(runtime: Runtime, failures: Sequence[Failure], lone: Sequence[str] = ()) -> str:
    """The note of a divergence no majority can settle (``lone``: the leaves whose
    diverged block only its model group holds, :func:`_lone_blocks`)."""
    if lone:
        return (
            f"the copies of {', '.join(lone)} inside the model group differ: a block "
            "sharded over the data axis (shard_state) has no twin in another group, so "
            "no majority copy can rebuild it. error.state is the state as it stands, "
            "holding the copies that differ: resuming from it fails again"
        )
    diverged = [f for f in failures if f.status & Status.DIVERGED]
    if _pair(runtime, diverged):
        a, b = diverged
        what = (
            f"a shard of {a.leaf} (replicas=2: each shard has one twin)"
            if runtime.options.replicas == 2
            else f"the state (a step on two devices), first in {a.leaf}"
        )
        return (
            f"devices {a.device_id} and {b.device_id} hold the two copies of {what} and "
            "the copies differ: no majority can tell which one is right, so either device "
            "may be the healthy one. error.state is the state as it stands, holding one "
            "of the two copies: resuming from it fails again"
        )
    return (
        "no majority of replicas agrees (every copy differs): error.state is the state "
        "as it stands, holding copies that differ"
    )


def _lone_blocks(runtime: Runtime, state: TrainState, failures: Sequence[Failure]) -> list[str]:
    """Under ``model_parallel`` with a sharded layout: the diverged leaves whose blocks
    only their model group holds (a shard of the data axis, each of its devices a copy
    of it: no other group's copy can rebuild one), by name; empty otherwise."""
    options = runtime.options
    if options.model_parallel == 1 or options.shard_state is None or options.replicas > 1:
        return []
    sharded = runtime.shards(state)
    if sharded is None:
        return []
    names = runtime.names["state"]
    leaves = {f.leaf for f in failures if f.status & Status.DIVERGED}
    return [n for n, s in zip(names, sharded, strict=True) if s and n in leaves]


def majority_position(runtime: Runtime, failures: Sequence[Failure]) -> int | None:
    """When a replica diverged: the position of a device this process holds whose copy
    agrees with the majority (None: none, or no replica diverged). Under ``replicas``
    a copy is a whole group's: the device's group holds no diverged device."""
    if not any(f.status & Status.DIVERGED for f in failures):
        return None
    bad = {f.device_id for f in failures}
    here = jax.process_index()  # a healthy copy this process can read
    k = runtime.options.replicas  # under replicas a copy is a whole group's
    m = len(runtime.devices) // k if k > 1 else 1
    groups = {i // m for i, d in enumerate(runtime.devices) if d.id in bad}
    good = [
        i
        for i, d in enumerate(runtime.devices)
        if d.id not in bad and i // m not in groups and d.process_index == here
    ]
    return good[0] if good else None


def _repeated_drops(runtime: Runtime, table: HealthTable) -> list[int]:
    """Under ``drop``, the ids of the failing devices left out of
    ``max_consecutive_drops`` steps in a row (they halted the run)."""
    limit = runtime.options.max_consecutive_drops
    if runtime.options.on_failure != "drop" or limit is None:
        return []
    return [
        d.id
        for i, d in enumerate(runtime.devices)
        if table.status[i] and table.consecutive_drops[i] >= limit
    ]


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.array(True)]))


def _params_finite(params: Any) -> bool:
    """One reduction on the devices, over the parameters as they lie (sharded or
    not: nothing gathered), and one scalar read: only on the failure path."""
    return bool(_all_finite(params))


def replica_state(step: TrainStep, state: TrainState, position: int) -> TrainState:
    """The state as held by ``step.devices[position]``, placed afresh on every device
    (unhalted): how a run recovers from one corrupted replica.

    Args:
      step: the step that owns ``state``.
      state: a state of ``step`` whose replicas differ.
      position: the position in ``step.devices`` of a device whose copy is good.

    Returns:
      That device's copy on every device of the step.

    Example:
      Device 1's copy of ``['w']`` is corrupted; device 0's copy, placed on every device,
      is whole again:

      >>> from jaxstep import replica_state
      >>> from jaxstep.testing import assert_replicas_equal, corrupt_replica, tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> bad = corrupt_replica(tiny.step, tiny.state(), tiny.step.devices[1].id, "['w']")
      >>> good = replica_state(tiny.step, bad, position=0)
      >>> assert_replicas_equal(tiny.step, good)  # every copy alike: passes
    """
    return replica_state_on(runtime_of(step), state, position)


def replica_state_on(runtime: Runtime, state: TrainState, position: int) -> TrainState:
    """:func:`replica_state` on a step's runtime."""
    host = runtime.read_at(state, position)
    return runtime.place_state(dataclasses.replace(host, halted=np.zeros((), bool)))

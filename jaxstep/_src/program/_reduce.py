"""The step's one collective and what it tells: each device's gradients, float model
state and one-hot health row summed in one all-reduce (:func:`all_reduce`: the sum of
one-hot rows is a gather, and the step-wide counts the verdict needs ride along), and
what the gathered rows tell that no device knew alone (:func:`compare_devices`: the
replicas that diverged, the faults that fired anywhere)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxstep._src.core import COL
from jaxstep._src.core import COLUMNS
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program import _cross_checks as cross_checks
from jaxstep._src.program import _drop as drop
from jaxstep._src.program._gathered import Gathered
from jaxstep._src.program._gathered import Reduced
from jaxstep._src.program._gathered import Seen
from jaxstep._src.program._local import Here
from jaxstep._src.program._local import LocalPart
from jaxstep._src.program._options import Options
from jaxstep._src.program._policies import OnFailure
from jaxstep._src.program._verdict import halting_status


def all_reduce(
    options: Options, policy: OnFailure, state: TrainState, part: LocalPart, at: Here
) -> Reduced:
    """The first collective: the health rows (one-hot, so the sum is a gather), the
    count of devices failing or halting so far (summed: the verdict needs no
    reduction over the table), the float model state, the fingerprints and the fault
    flags ride in the gradients' all-reduce."""
    summed, sent = send(options, policy, state, part, at)
    grads, floats = part.grads, floats_of(part.work.model_state)
    # drop: a failing device sends zeros, left out of the mean
    grads, floats = policy.leave_out(summed[0], (grads, floats))
    # The gradients stay summed here: the division by n happens inside the update,
    # where it fuses into the optimizer's pass (a kernel and a pass per leaf saved).
    grad_sums, floats, gathered = jax.lax.psum((grads, floats, sent), options.axis_name)
    return received(options, policy, part, summed, grad_sums, floats, gathered)


def send(
    options: Options, policy: OnFailure, state: TrainState, part: LocalPart, at: Here
) -> tuple[list[jax.Array], jax.Array]:
    """This device's columns summed over the devices (``summed``) and what it sends
    of the health table (its one-hot row, the summed columns, its fingerprints' halves
    and the faults' fire flags)."""
    n, status, index = options.n, part.row["status"], at.position
    extra = []
    if part.prints is not None:
        extra.append(cross_checks.split16(part.prints))
    if at.faults:
        extra.append(at.faults.fire_flags().astype(jnp.float32))
    halting = int(halting_status(options))
    summed = [
        (status & ~int(Status.OVERFLOW)) != 0,
        (status & int(Status.OVERFLOW)) != 0,
        (status & halting) != 0,
        # The state's halted flag and step (from the first device, in exact 16-bit
        # halves), read here, before the all-reduce, and not after: XLA then updates
        # their donated buffers in place instead of copying them first.
        state.halted,
        jnp.where(index == 0, state.step // 65536, 0),
        jnp.where(index == 0, state.step % 65536, 0),
    ]
    summed += policy.summed(state, summed[0], index)
    # the counters the verdict reads (skip, drop), gathered here (as above)
    row = {**part.row, **policy.counters(state, index)}
    sent = health.onehot_rows(row, index, n, summed, jnp.concatenate(extra) if extra else None)
    return summed, sent


def received(
    options: Options,
    policy: OnFailure,
    part: LocalPart,
    summed: list[jax.Array],
    grad_sums: PyTree,
    floats: list[jax.Array],
    gathered: jax.Array,
) -> Reduced:
    """What the all-reduce gathered, unpacked: the rows, the step-wide facts, the
    float model state averaged (over the devices kept, under ``drop``)."""
    width = len(COLUMNS) + len(summed)
    rows = gathered[:, : len(COLUMNS)]  # every device's row, as packed
    counts = gathered[0, len(COLUMNS) : width]
    share = policy.share(counts[0])  # drop: the mean over the devices not left out
    floats = [share(x) for x in floats]
    model_state = with_floats(part.work.model_state, floats)
    skips, drops = policy.gathered(rows)
    seen = Seen(
        failed=counts[0] > 0,
        overflow=counts[1] > 0,
        halt=counts[2] > 0,
        halted=counts[3] > 0,
        step=counts[4].astype(jnp.int32) * 65536 + counts[5].astype(jnp.int32),
        failing=counts[0],
        repeats=counts[6] > 0 if len(summed) > 6 else None,
        skips=skips,
        drops=drops,
    )
    rest = gathered[:, width:]
    status = rows[:, COL["status"]].astype(jnp.int32)
    return Reduced(grad_sums, model_state, rows, seen, rest, status)


def compare_devices(
    options: Options,
    policy: OnFailure,
    reduced: Reduced,
    part: LocalPart,
    at: Here,
    extras: dict[str, Any],
    repair: drop.Repair | None = None,
    twinned: Sequence[bool] | None = None,
    groups: int = 1,
) -> tuple[Gathered, dict[str, Any]]:
    """What the gathered rows tell that no device knew alone: which replicas diverged
    (the fingerprints' minority; under ``drop``, ``repair`` found them before the
    local part; the leaves of ``twinned``, shards of ``groups`` replica groups,
    compared among their twins) and which faults fired anywhere. Returns what the
    verdict and the update take (:class:`~jaxstep._src.program._verdict.Gathered`) and the
    extras."""
    status, seen, rest = reduced.status, reduced.seen, reduced.rest
    columns: dict[str, jax.Array] = {}
    seen = policy.mark(seen, status)
    if repair is not None:
        added = jnp.where(repair.diverged, int(Status.DIVERGED), 0)
        status |= added
        seen = seen.add(added, int(halting_status(options)))
        columns["diverged_leaf"] = repair.first
        columns["repaired"] = repair.repaired
    if part.prints is not None:
        prints = part.prints
        joined = cross_checks.join16(rest[:, : 2 * prints.shape[0]])
        diverged, first = cross_checks.minority(joined, twinned, groups)
        added = jnp.where(diverged, int(Status.DIVERGED), 0)
        status |= added
        seen = seen.add(added, int(halting_status(options)))
        columns["diverged_leaf"] = first
    if at.faults:
        fired = jnp.any(rest[:, rest.shape[1] - at.faults.count :] > 0, axis=0)
        extras = dict(extras, fired=extras["fired"] | fired)
    losses = reduced.rows[:, COL["loss"]]
    gathered = Gathered(
        losses, status, seen, columns, reduced.grad_sums, reduced.model_state, reduced.rows
    )
    return gathered, extras


def floats_of(tree: PyTree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def with_floats(tree: PyTree, floats: list[jax.Array]) -> PyTree:
    """``tree`` with its float leaves replaced, in order, by ``floats``."""
    it = iter(floats)
    return jax.tree.map(lambda x: next(it) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)

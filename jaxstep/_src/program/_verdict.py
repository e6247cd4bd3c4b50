"""The verdict every device reaches alike, from what the all-reduce gathered, and the
update it allows.

``Seen`` (the step-wide facts summed in the all-reduce) -> :func:`verdict` (loss spike,
skip, halt, drop, loss scale) -> :func:`update` (the optimizer under ``lax.cond``, or
checked first with ``verify_update``). Pure functions over an immutable
:class:`~jaxstep._src.program._options.Options`, called by :func:`jaxstep._src.program.body`.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Protocol

import jax
import jax.numpy as jnp
import optax

from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program._gathered import Gathered
from jaxstep._src.program._gathered import Seen
from jaxstep._src.program._local import Here
from jaxstep._src.program._options import Options
from jaxstep._src.program._policies import OnFailure

__all__ = [
    "ALWAYS_HALT",
    "InPlace",
    "View",
    "halting_status",
    "update",
    "verdict",
]

# Failures that skipping a step cannot cure: they halt under either policy.
ALWAYS_HALT = Status.DIVERGED | Status.HUNG


def halting_status(options: Options) -> Status:
    """Failures that halt under either policy: skipping cannot repair a diverged
    replica, nor parameters that are already non-finite (found by the periodic
    check; ``verify_update`` never commits them)."""
    return ALWAYS_HALT if options.verify_update else ALWAYS_HALT | Status.PARAM_NONFINITE


class View(Protocol):
    """The update's view of the state's layout: the parameters as the optimizer sees
    them (under a sharded layout their shards: the update runs on each device's shard
    of the optimizer state, after the ``shard_map``, over global arrays) and as the
    state holds them, and ``verify_update``'s check of the new parameters each device
    computed."""

    def to_shards(self, params: Params) -> Params: ...
    def to_state(self, params: Params) -> Params: ...
    def verify(self, params: Params) -> jax.Array: ...


class InPlace:
    """:class:`View` of a replicated layout, inside the ``shard_map`` (``at``: where this
    device stands): every device updates its whole copy."""

    def __init__(self, options: Options, at: Here):
        self.options, self.at = options, at

    def to_shards(self, params: Params) -> Params:
        return params

    def to_state(self, params: Params) -> Params:
        return params

    def verify(self, params: Params) -> jax.Array:
        """Every device's first non-finite leaf of its new parameters ((n,), -1: none),
        one small ``psum``."""
        checked = self.at.faults.params(params)
        leaf = health.first_nonfinite(jax.tree.leaves(checked))[1]
        mine = jnp.arange(self.options.n) == self.at.position
        return jax.lax.psum(jnp.where(mine, leaf, 0), self.options.axis_name)


def update(
    options: Options,
    policy: OnFailure,
    state: TrainState,
    gathered: Gathered,
    view: View,
) -> tuple[TrainState, jax.Array, dict[str, jax.Array]]:
    """Decides, then updates. By default everything the verdict needs is known
    before the update, so a ``lax.cond`` skips it on failure: no second pass over
    the state and no extra memory. ``verify_update=True`` also checks the new
    parameters before committing them (one more pass, and a second collective).
    ``gathered.grad_sums`` are the gradients summed over the devices (divided here,
    inside the optimizer's pass, as ``policy`` shares them). Returns the new state,
    every device's status and the table columns to write. ``view``: the layout's view
    of the state (:class:`InPlace` inside the ``shard_map``, or a sharded layout's
    over global arrays after it)."""
    losses, status, seen, columns, grad_sums, model_state, _ = gathered
    mean = policy.share(seen.failing)

    def apply(operands: tuple[Params, PyTree, PyTree]) -> tuple[Params, PyTree, PyTree]:
        params, opt_state, _ = operands
        grads = jax.tree.map(mean, grad_sums)
        params = view.to_shards(params)  # the optimizer's math on each device's shard
        updates, opt_state = options.optimizer.update(grads, opt_state, params)
        return view.to_state(optax.apply_updates(params, updates)), opt_state, model_state

    old = (state.params, state.opt_state, state.model_state)
    columns = dict(columns)
    if options.verify_update:
        new = apply(old)
        leaves = view.verify(new[0])
        # After a bad gradient every replica's update is bad too: that is the
        # gradient's fault, so parameters are blamed only when nothing else failed.
        bad = (leaves >= 0) & ~policy.cleared(seen) & ~seen.overflow
        columns["param_leaf"] = jnp.where(bad, leaves, -1)
        added = jnp.where(bad, int(Status.PARAM_NONFINITE), 0)
        status = status | added
        seen = seen.add(added, int(halting_status(options)))
    status, ok, fields, verdict_columns = verdict(options, policy, state, losses, status, seen)
    if options.verify_update:
        params, opt_state, model_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    else:
        params, opt_state, model_state = jax.lax.cond(ok, apply, lambda operands: operands, old)
    new_state = dataclasses.replace(
        state, params=params, opt_state=opt_state, model_state=model_state, **fields
    )
    return new_state, status, {**columns, **verdict_columns}


def verdict(
    options: Options,
    policy: OnFailure,
    state: TrainState,
    losses: jax.Array,
    status: jax.Array,
    seen: Seen,
) -> tuple[jax.Array, jax.Array, dict[str, Any], dict[str, jax.Array]]:
    """(every device's status, ok to update, the new state's other fields, the
    step-wide verdict columns of the table). ``seen``: what ``status`` holds, step-wide
    (failed, overflow, must halt)."""
    monitor = state.monitor
    spike = options.loss_spike
    if spike is not None:
        spiked = spike.check(state.monitor["spike"], losses) & (status == 0)
        added = jnp.where(spiked, int(Status.LOSS_SPIKE), 0)
        status = status | added
        seen = seen.add(added, int(halting_status(options)))
    overflow, must_halt = seen.overflow, seen.halt
    failed = policy.failed(seen)
    scaler, scale_state = options.loss_scale, state.loss_scale
    if scaler is not None:  # an overflow at the minimum scale cannot be skipped away
        assert scale_state is not None  # init gave it one; a state without fails its check
        failed |= overflow & scaler.at_minimum(scale_state)
    skips = state.consecutive_skips if seen.skips is None else seen.skips
    halt_now, skipped = policy.halt_or_skip(failed, must_halt, skips, seen.halted)
    rescaled = overflow & ~failed & ~seen.halted  # skipped on every device, not a failure
    ok = ~failed & ~overflow & ~seen.halted
    drop_fields: dict[str, Any] = {}
    drop_columns: dict[str, jax.Array] = {}
    decided = policy.decide(state, seen, ok)
    if decided is not None:  # the policy's own part (drop: a bad device halts the run)
        bad_device, drop_fields, drop_columns = decided
        ok &= ~bad_device
        halt_now |= bad_device
        failed |= bad_device
    halted = seen.halted | halt_now
    if spike is not None:
        monitor = {**monitor, "spike": spike.update(state.monitor["spike"], losses, ok)}
    if "drops" in drop_fields:
        monitor = {**monitor, "drops": drop_fields.pop("drops")}
    consecutive = jnp.where(ok, 0, skips + skipped).astype(jnp.int32)
    columns = {
        "step": seen.step,
        "halted": halted,
        "skipped": skipped | rescaled,
        "consecutive_skips": consecutive,
        "failed": failed,
        **drop_columns,
    }
    fields = {
        "step": seen.step + (ok | skipped | rescaled),
        "halted": halted,
        "consecutive_skips": consecutive,
        "total_skips": state.total_skips + skipped,
        "monitor": monitor,
        **drop_fields,
    }
    if scaler is not None and scale_state is not None:  # both or neither (asserted above)
        fields["loss_scale"] = scaler.update(scale_state, rescaled, ok)
    return status, ok, fields, columns

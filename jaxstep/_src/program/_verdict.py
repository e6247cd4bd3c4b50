"""The verdict every device reaches alike, from what the all-reduce gathered, and the
update it allows.

``Seen`` (the step-wide facts summed in the all-reduce) -> :func:`verdict` (loss spike,
skip, halt, drop, loss scale) -> :func:`update` (the optimizer under ``lax.cond``, or
checked first with ``verify_update``). Pure functions over an immutable
:class:`~jaxstep._src.program._options.Options`, called by :func:`jaxstep._src.program.body`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
import jax.numpy as jnp
import optax

from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program import _drop as drop
from jaxstep._src.program._local import Here
from jaxstep._src.program._options import Options

__all__ = [
    "ALWAYS_HALT",
    "Gathered",
    "Seen",
    "Sharded",
    "halting_status",
    "times_share",
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


class Seen(NamedTuple):
    """Step-wide facts, taken from the all-reduce: whether any device failed,
    overflowed or must halt (counted there for the status set before it, so the
    verdict needs no reduction over the table; the few optional checks that set
    status after it add theirs with :meth:`add`), and the state's ``halted`` flag and
    ``step`` as they were before the step."""

    failed: jax.Array
    overflow: jax.Array
    halt: jax.Array
    halted: jax.Array
    step: jax.Array
    #: the devices that failed their own checks before the all-reduce, counted (float)
    failing: jax.Array
    #: ``drop``: which devices failed their own checks ((n,) bool; None otherwise)
    left_out: jax.Array | None = None
    #: a failure found after the all-reduce (``add``): leaving a device out cannot cure it
    late: jax.Array | bool = False
    #: ``drop``: whether a device failed ``max_consecutive_drops`` steps in a row
    repeats: jax.Array | None = None
    #: under ``skip`` and ``drop``, the state's ``consecutive_skips``, and under
    #: ``drop`` its ``monitor["drops"]``, as gathered by the all-reduce: read before it
    #: and not after, so XLA updates their donated buffers in place (no copy kernels)
    skips: jax.Array | None = None
    drops: jax.Array | None = None

    def add(self, bits: jax.Array, halting: int) -> Seen:
        """With every device's ``bits`` (``(n,)`` Status bits) added."""
        failed = jnp.any((bits & ~int(Status.OVERFLOW)) != 0)
        return self._replace(
            late=self.late | failed,
            failed=self.failed | failed,
            overflow=self.overflow | jnp.any((bits & int(Status.OVERFLOW)) != 0),
            halt=self.halt | jnp.any((bits & halting) != 0),
        )


class Gathered(NamedTuple):
    """What every device holds once the step's collective gathered it: what the verdict
    and the update take."""

    losses: jax.Array  # (n,) every device's loss
    status: jax.Array  # (n,) every device's Status bits, the cross-device checks' included
    seen: Seen  # the step-wide facts
    columns: dict[str, jax.Array]  # the table's columns found after the gather
    grad_sums: PyTree  # the gradients summed over the devices (a shard of each sharded leaf)
    model_state: PyTree  # the new model state, its float leaves averaged
    rows: jax.Array  # (n, columns) every device's health row, as packed


class Sharded(Protocol):
    """What :func:`update` needs of a sharded layout (``shard_state``), where it runs
    after the ``shard_map``, over global arrays: the parameters as the optimizer sees
    them (their shards: the update runs on each device's shard of the optimizer
    state) and as the state holds them, and ``verify_update``'s check of each device's
    own shard of the new parameters."""

    def to_shards(self, params: Params) -> Params: ...
    def to_state(self, params: Params) -> Params: ...
    def verify(self, params: Params) -> jax.Array: ...


def update(
    options: Options,
    state: TrainState,
    gathered: Gathered,
    *,
    at: Here | None = None,
    shards: Sharded | None = None,
) -> tuple[TrainState, jax.Array, dict[str, jax.Array]]:
    """Decides, then updates. By default everything the verdict needs is known
    before the update, so a ``lax.cond`` skips it on failure: no second pass over
    the state and no extra memory. ``verify_update=True`` also checks the new
    parameters before committing them (one more pass, and a second collective).
    ``gathered.grad_sums`` are the gradients summed over the devices (divided here,
    inside the optimizer's pass). Returns the new state, every device's status and the
    table columns to write. ``at``: where this device stands (inside the
    ``shard_map``); ``shards``: a sharded layout, where this runs outside the
    ``shard_map`` on global arrays (``at`` None)."""
    losses, status, seen, columns, grad_sums, model_state, _ = gathered
    mean: Callable[[jax.Array], jax.Array] = lambda g: g / options.n  # noqa: E731
    if options.on_failure == "drop":  # the mean over the devices not left out
        # times the reciprocal, not divided: a multiply by a scalar fuses into both of
        # the optimizer's passes that read it, where a divide got a pass of its own
        healthy = jnp.maximum(options.n - seen.failing, 1)
        mean = lambda g: times_share(g, healthy)  # noqa: E731

    def apply(operands: tuple[Params, PyTree, PyTree]) -> tuple[Params, PyTree, PyTree]:
        params, opt_state, _ = operands
        grads = jax.tree.map(mean, grad_sums)
        if shards is not None:  # the optimizer's math on each device's shard
            params = shards.to_shards(params)
            updates, opt_state = options.optimizer.update(grads, opt_state, params)
            return shards.to_state(optax.apply_updates(params, updates)), opt_state, model_state
        updates, opt_state = options.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, model_state

    old = (state.params, state.opt_state, state.model_state)
    columns = dict(columns)
    if options.verify_update:
        new = apply(old)
        if shards is None:
            assert at is not None  # inside the shard_map
            ctx = at.ctx
            checked = new[0] if ctx is None else options.injector.tree("param", new[0], ctx)
            leaf = health.first_nonfinite(jax.tree.leaves(checked))[1]
            mine = jnp.arange(options.n) == at.position
            leaves = jax.lax.psum(jnp.where(mine, leaf, 0), options.axis_name)
        else:  # each device checks the shard it computed
            leaves = shards.verify(new[0])
        # After a bad gradient every replica's update is bad too: that is the
        # gradient's fault, so parameters are blamed only when nothing else failed.
        # (Under drop, the failing devices' gradients are not in the update.)
        cleared = seen.late if options.on_failure == "drop" else seen.failed
        bad = (leaves >= 0) & ~cleared & ~seen.overflow
        columns["param_leaf"] = jnp.where(bad, leaves, -1)
        added = jnp.where(bad, int(Status.PARAM_NONFINITE), 0)
        status = status | added
        seen = seen.add(added, int(halting_status(options)))
    status, ok, fields, verdict_columns = verdict(options, state, losses, status, seen)
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
    overflow, failed, must_halt = seen.overflow, seen.failed, seen.halt
    if options.on_failure == "drop":  # what leaving the failing devices out cannot cure
        failed = seen.late | must_halt | (seen.failing > options.dropped_limit)
    scaler, scale_state = options.loss_scale, state.loss_scale
    if scaler is not None:  # an overflow at the minimum scale cannot be skipped away
        assert scale_state is not None  # init gave it one; a state without fails its check
        failed |= overflow & scaler.at_minimum(scale_state)
    skips = state.consecutive_skips if seen.skips is None else seen.skips
    if options.on_failure in ("skip", "drop"):
        limit = options.max_consecutive_skips
        halt_now = must_halt
        if limit is not None:
            halt_now |= failed & (skips + 1 >= limit)
        skipped = failed & ~halt_now & ~seen.halted
    else:
        halt_now = failed
        skipped = jnp.array(False)
    rescaled = overflow & ~failed & ~seen.halted  # skipped on every device, not a failure
    ok = ~failed & ~overflow & ~seen.halted
    drop_fields: dict[str, Any] = {}
    drop_columns: dict[str, jax.Array] = {}
    if options.on_failure == "drop":
        bad_device, _, drop_fields, drop_columns = drop.decide(options, state, seen, ok)
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


def times_share(x: jax.Array, healthy: jax.Array) -> jax.Array:
    """``x / healthy`` as a multiply by the reciprocal, taken in at least float32 and in
    ``x``'s own precision when higher (float64 under x64), rounded to ``x``'s dtype once:
    the counts are float32, so a reciprocal cast to bfloat16 first was off by 0.2%."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return (x.astype(wide) * (1 / healthy.astype(wide))).astype(x.dtype)

"""``make_train_step``: gathers its keywords into one checked
:class:`~jaxstep._src.program.Options`, then builds the :class:`TrainStep` from it."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import optax

from jaxstep._src.core import BackendName
from jaxstep._src.core import Policy
from jaxstep._src.core import ShardState
from jaxstep._src.program import AXIS
from jaxstep._src.program import DEFAULT_DIVERGENCE_EVERY
from jaxstep._src.program import DEFAULT_SHARD_MIN_SIZE
from jaxstep._src.program import DynamicLossScale
from jaxstep._src.program import Fault
from jaxstep._src.program import LossSpike
from jaxstep._src.program import ModelRule
from jaxstep._src.program import Options
from jaxstep._src.program import ShardRule
from jaxstep._src.step._train_step import TrainStep


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    backend: BackendName = "shard_map",
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    on_failure: Policy = "raise",
    max_consecutive_skips: int | None = 10,
    max_dropped: int | None = None,
    max_consecutive_drops: int | None = 3,
    divergence_every: int | None = DEFAULT_DIVERGENCE_EVERY,
    loss_spike: LossSpike | None = None,
    verify_update: bool = False,
    faults: Sequence[Fault] = (),
    donate: bool = True,
    axis_name: str = AXIS,
    microbatches: int = 1,
    loss_scale: DynamicLossScale | None = None,
    shard_state: ShardState | None = None,
    shard_min_size: int = DEFAULT_SHARD_MIN_SIZE,
    replicas: int = 1,
    shard_rule: ShardRule | None = None,
    model_parallel: int = 1,
    model_rule: ModelRule | None = None,
) -> TrainStep:
    """Builds a checked data-parallel training step.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux=True``; or ``loss_fn(params, batch, rng)`` when the state holds a
        key). ``batch`` is this device's chunk. ``aux["checks"]`` may be a dict of
        named boolean scalars: a False one fails the device with ``CHECK_FAILED``.
      optimizer: an optax transformation; it receives the mean gradient.
      backend: ``"shard_map"`` (state replicated) or ``"pmap"`` (state and outputs
        with a leading device axis).
      devices: the devices to use, default ``jax.devices()``. Chunk i of every batch
        runs on ``devices[i]``.
      has_aux: whether loss_fn returns ``(loss, aux)``.
      on_failure: ``"raise"``: a failed step freezes the state (``halted``) and
        :func:`fit` raises; ``"skip"``: the update is discarded on every device and
        training goes on, until ``max_consecutive_skips`` failures in a row halt it;
        ``"drop"``: a device whose own checks fail (non-finite input, loss, gradient or
        model state, or a user check) is left out of the step's mean and the update
        uses the mean over the healthy devices (no extra collective); a step with more
        than ``max_dropped`` failing devices, or a failure found only after the
        all-reduce (a loss spike), is skipped as under ``"skip"``, and a replica that
        differs from a strict majority is repaired from it inside the step (once per
        device). A diverged replica halts under ``"raise"`` and ``"skip"``.
      max_consecutive_skips: with ``"skip"``, the N-th failed step in a row halts the
        run (after N-1 skips) and :func:`fit` raises (None: never); with ``"drop"``
        the same for steps skipped whole.
      max_dropped: with ``"drop"``, the most devices one step may leave out (None:
        fewer than half, ``(n - 1) // 2``); a step with more is skipped whole.
      max_consecutive_drops: with ``"drop"``, a device left out this many steps in a
        row is a bad device, not bad data: the run halts and :func:`fit` raises naming
        it (None: never).
      divergence_every: every this many steps each device fingerprints its copy of
        the parameters and optimizer state; a device that disagrees with the majority
        fails with ``DIVERGED`` (None: never); under ``"drop"`` its copy is first
        repaired from a majority replica, inside the step, once per device.
      loss_spike: a :class:`jaxstep.LossSpike` to fail devices whose loss jumps
        (``LOSS_SPIKE``); None: off.
      verify_update: also check the parameters after the update, per device, and
        commit them only if finite (``PARAM_NONFINITE``): exact, but one more pass over
        the state, its memory and a second small collective. Off, non-finite
        parameters are still caught at the start of every ``divergence_every``-th step,
        and an update from finite gradients rarely overflows.
      faults: :class:`jaxstep.testing.Fault` s compiled into the step (tests, demos).
      donate: donate the state's buffers to the step (saves memory; the state passed
        in must not be used again).
      axis_name: the name of the device axis, bound on both backends, so that
        ``loss_fn`` (or the model: ``BatchNorm(axis_name=...)``) may use
        ``lax.psum``/``lax.pmean`` over the devices. Which checks stay per-device
        when the model communicates: see docs/flax.md.
      microbatches: accumulate the mean gradient over this many equal slices of each
        device's chunk inside the step (a ``lax.scan``); health is checked per
        micro-batch and the first failing one is ``err.microbatch``. ``state.step``
        counts batches (with ``optax.MultiSteps``, updates are every k-th of them).
      loss_scale: a :class:`jaxstep.DynamicLossScale` for fp16: each device finds its
        own overflow before the all-reduce; an overflowing step is skipped on every
        device, recorded as ``Status.OVERFLOW`` (not a failure) and the scale backs
        off; at the minimum scale an overflow raises. bf16 needs none.
      shard_state: what is sharded over the devices (``backend="shard_map"`` only):
        None (every device holds the whole state); ``"optimizer"`` (ZeRO-1: the
        optimizer state sharded, the parameters replicated; each device's gradient
        is checked, then reduce-scattered, each device updates its shard, the new
        parameters are all-gathered); ``"params"`` (FSDP: parameters and optimizer
        state sharded; each parameter is gathered for the loss, and the gradient that
        flows back for it is checked on each device before it is reduce-scattered).
        Every check keeps its meaning (docs/sharding.md). The state's leaves are
        global arrays with their logical shapes.
      shard_min_size: leaves with fewer elements stay replicated (default ``2**16``:
        below it the extra collectives cost more than the sharded update saves). A
        leaf is sharded along its largest axis that divides by the device count (the
        first on ties); one with no such axis stays replicated.
      replicas: with ``shard_state``, the devices form this many groups of ``n /
        replicas`` consecutive devices (in ``devices`` order): the state is sharded
        inside a group and whole in each (hybrid sharding: MaxText's ``dcn_data`` x
        ``ici_fsdp``, FSDP2's HSDP); the gradients are reduce-scattered inside a group
        and all-reduced across groups, and every shard has ``replicas - 1`` twins that
        the replica check compares. Default 1 (one group).
      shard_rule: ``fn(path, shape) -> axis | None`` in place of the default rule:
        the axis each parameter is split along over a group (``path`` as
        ``jax.tree_util.keystr`` writes it; None: whole); an optimizer-state leaf that
        mirrors a parameter takes its axis (``jaxstep.flax.shard_rule`` makes one from
        flax's partitioning metadata). ``shard_min_size`` applies to it too: a smaller
        leaf stays whole whatever the rule says.
      model_parallel: devices per model group (tensor parallelism; default 1). The
        mesh is ``(data, model)`` over ``devices`` in order, the model axis fastest:
        ``devices[g * m : (g + 1) * m]`` is group ``g``, which takes chunk ``g`` of
        every batch. ``loss_fn`` is written as for one device (it sees its chunk and
        every parameter's global shape); XLA partitions the model axis
        (:data:`jaxstep.MODEL_AXIS`; constrain an activation with
        ``jax.lax.with_sharding_constraint(x, P(None, jaxstep.MODEL_AXIS))``). A group
        is the unit that checks itself: its gradient is checked before anything
        crosses the data axis, and a failure names its first device (``device_id``)
        and all of them (``err.group``). ``step.devices`` holds each group's first
        device. A group stays inside a process. ``backend="shard_map"``; with
        ``shard_state`` each leaf is also sharded over the data axis, along a dimension
        the model axis does not split (FSDP or ZeRO-1 x tensor parallelism;
        ``replicas=1``) (docs/model-parallel.md).
      model_rule: ``fn(path, shape) -> dim | None``: the dimension of a parameter
        split over a model group (None: whole on each of its devices); an
        optimizer-state leaf that mirrors a parameter takes its dimension
        (``jaxstep.flax.model_rule`` makes one from flax's partitioning metadata).
        None: every leaf whole (the model axis then only splits what XLA chooses to).

    Returns:
      A :class:`TrainStep`: ``state = step.init(params)``, ``state, out = step(state, batch)``.

    Raises:
      ValueError, TypeError: an argument is invalid; the message names it and the fix.

    Example:
      >>> import jax.numpy as jnp, optax, jaxstep
      >>> step = jaxstep.make_train_step(
      ...     lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), optax.sgd(0.1))
      >>> state = step.init({"w": jnp.zeros(())})
      >>> batch = {"x": jnp.ones(16), "y": 2 * jnp.ones(16)}
      >>> state, out = step(state, batch)
      >>> round(float(out.metrics["loss"]), 3)
      4.0
    """
    options = Options(
        loss_fn,
        optimizer,
        backend=backend,
        devices=jax.devices() if devices is None else devices,
        has_aux=has_aux,
        on_failure=on_failure,
        max_consecutive_skips=max_consecutive_skips,
        max_dropped=max_dropped,
        max_consecutive_drops=max_consecutive_drops,
        divergence_every=divergence_every,
        loss_spike=loss_spike,
        verify_update=verify_update,
        faults=(faults,) if isinstance(faults, Fault) else faults,  # one, not in a list
        donate=donate,
        axis_name=axis_name,
        microbatches=microbatches,
        loss_scale=loss_scale,
        shard_state=shard_state,
        shard_min_size=shard_min_size,
        replicas=replicas,
        shard_rule=shard_rule,
        model_parallel=model_parallel,
        model_rule=model_rule,
    )
    return TrainStep(options)

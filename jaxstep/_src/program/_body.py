"""The per-device program: what every device runs inside ``shard_map`` / ``pmap``.

its local part (:mod:`jaxstep._src.program._local`: input, loss, gradients, checks) -> one
all-reduce of (gradients, model state, health rows) and the checks that compare the
devices' rows (:mod:`jaxstep._src.program._reduce`) -> the same verdict on every device and
the optimizer update under ``lax.cond`` (:mod:`jaxstep._src.program._verdict`). Pure
functions over an immutable :class:`~jaxstep._src.program._options.Options`; nothing here
touches host state.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import StepInfo
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program import _drop as drop
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import here
from jaxstep._src.program._local import local_part
from jaxstep._src.program._options import Options
from jaxstep._src.program._reduce import all_reduce
from jaxstep._src.program._reduce import compare_devices
from jaxstep._src.program._verdict import update


def body(
    options: Options,
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    check_replicas: bool,
) -> tuple[TrainState, StepOutput, dict[str, Any]]:
    """One device's step. ``check_replicas``: the every-``divergence_every``-th variant that
    also fingerprints this device's copy of the state; ``beat``: call it once the
    local part is done (before the collective). Returns the extras it changed (not
    ``chunk``)."""
    at = here(options, state, batch, extras)
    repair = None
    if options.on_failure == "drop" and check_replicas:  # a diverged replica is repaired first
        state, repair = drop.repair_replicas(options, state, at.position)
    # 1. input, 2. loss and gradients, 3. local health: all before any collective.
    part = local_part(options, state, batch, at, beat=beat, check_replicas=check_replicas)
    # 4. the first collective, 5. the checks that compare the devices' rows.
    reduced = all_reduce(options, state, part, at)
    gathered, extras = compare_devices(options, reduced, part, at, extras, repair)
    # 6.-8. the verdict, the same on every device, and the update it allows.
    new_state, status, columns = update(options, state, gathered, at=at)
    table, metrics = outputs(options, gathered.rows, status, columns, gathered.losses)
    info = StepInfo(checks=part.checks)
    out = StepOutput(metrics=metrics, health=table, aux=part.work.aux, info=info)
    # only the extras a step changes go out (``fired``): an output chunk was a copy kernel
    return new_state, out, {k: v for k, v in extras.items() if k != "chunk"}


def map_body(
    body_fn: Callable[..., tuple[TrainState, StepOutput, dict[str, Any]]],
    mesh: Mesh,
    axis: str,
    extra_specs: Mapping[str, P],
) -> Callable[..., tuple[TrainState, StepOutput, dict[str, Any]]]:
    """``body_fn(state, batch, extras)`` (a device's step) mapped over ``mesh``'s
    devices: the state replicated, the batch split over ``axis``, ``extra_specs`` the
    extras'; the metrics and the health table come out replicated and each device's
    ``aux`` along a new leading axis, as pmap would return it.

    Without the varying-type check: under it, replicated parameters would have to be
    cast to device-varying before differentiating (else their gradients come back
    already summed over the devices and no check before the collective sees one
    device's values), and a user's scan whose carry starts from constants
    (flax.linen.RNN) fails to trace. The body's collectives are explicit; the outputs
    declared replicated are replicated by construction."""

    def stacked_aux(state: TrainState, batch: Batch, extras: dict[str, Any]) -> Any:
        new_state, out, changed = body_fn(state, batch, extras)
        return new_state, out._replace(aux=jax.tree.map(lambda x: x[None], out.aux)), changed

    changed_specs = {k: s for k, s in extra_specs.items() if k != "chunk"}  # body's out
    return jax.shard_map(
        stacked_aux,
        mesh=mesh,
        in_specs=(P(), P(axis), dict(extra_specs)),
        out_specs=(P(), StepOutput._make((P(), P(), P(axis), P())), changed_specs),
        check_vma=False,
    )


def outputs(
    options: Options,
    rows: jax.Array,
    status: jax.Array,
    columns: dict[str, jax.Array],
    losses: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The step's health table (the gathered ``rows`` with the verdict's ``columns``
    and every device's ``status`` written in) and its metrics (the mean loss, under
    ``drop`` over the chunks the step trained on)."""
    table = health.to_table(rows, {**columns, "status": status})
    metrics = {"loss": jnp.mean(losses)}
    if options.on_failure == "drop":  # the mean over the chunks the step trained on
        kept = ~columns["dropped"]
        metrics = {"loss": jnp.sum(jnp.where(kept, losses, 0.0)) / jnp.maximum(jnp.sum(kept), 1)}
    return table, metrics

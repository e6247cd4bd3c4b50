"""The per-device program: what every device runs inside ``shard_map`` / ``pmap``, one
body for every layout and policy.

its local part (:mod:`jaxstep._src.program._local`: input, loss, gradients, checks) -> the
layout's reduction of (gradients, model state, health rows) and the checks that
compare the devices' rows (:mod:`jaxstep._src.program._reduce`) -> the same verdict on
every device and the optimizer update under ``lax.cond``
(:mod:`jaxstep._src.program._verdict`), where the layout runs it. :class:`Step` binds a
variant of it to a layout (:mod:`jaxstep._src.program._layouts`) and a policy
(:mod:`jaxstep._src.program._policies`), both picked once; nothing here touches host
state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import StepInfo
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.core import health
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._layouts import Parted
from jaxstep._src.program._layouts import Replicated
from jaxstep._src.program._layouts import Result
from jaxstep._src.program._layouts import StateLayout
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import here
from jaxstep._src.program._model_dims import global_dims
from jaxstep._src.program._options import Options
from jaxstep._src.program._policies import OnFailure
from jaxstep._src.program._policies import policy_of
from jaxstep._src.program._reduce import compare_devices
from jaxstep._src.program._sharded import OptimizerShards
from jaxstep._src.program._sharded import ParamShards
from jaxstep._src.program._shards import Plan
from jaxstep._src.program._verdict import View
from jaxstep._src.program._verdict import update


def body(
    options: Options,
    layout: StateLayout,
    policy: OnFailure,
    state: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    *,
    beat: Beat | None,
    check_replicas: bool,
) -> Parted:
    """One device's step up to the update, under any ``layout`` and ``policy``.
    ``check_replicas``: the every-``divergence_every``-th variant that also compares
    the devices' copies of the state; ``beat``: call it once the local part is done
    (before the collective)."""
    at = here(options, state, batch, extras)
    sharded, grid = layout.replica_view(state)
    # drop: a diverged replica is repaired first
    state, repair = policy.repair(state, at, sharded, grid, check_replicas=check_replicas)
    if repair is not None and repair.prints is not None:  # of the copies handed on
        at = at._replace(prints=repair.prints)
    # 1. input, 2. loss and gradients, 3. local health: all before any collective.
    part, rerun = layout.local_part(
        policy, state, batch, at, beat=beat, check_replicas=check_replicas
    )
    if repair is not None:
        part = layout.compared_before(part)
    # 4. the reduction, 5. the checks that compare the devices' rows.
    reduced = layout.reduce(policy, state, part, at, rerun)
    twinned, groups = layout.twins(state)
    gathered, extras = compare_devices(
        options, policy, reduced, part, at, extras, repair, twinned, groups
    )
    repaired = state if repair is not None else None
    return Parted(gathered, extras, part.work.aux, StepInfo(checks=part.checks), repaired, at)


def finish(
    options: Options, policy: OnFailure, state: TrainState, parted: Parted, view: View
) -> tuple[TrainState, StepOutput]:
    """6.-8. The verdict, the same on every device, and the update it allows, from
    ``state`` as ``view`` (the layout's) holds it; the step's outputs."""
    gathered = parted.gathered
    new_state, status, columns = update(options, policy, state, gathered, view)
    table, metrics = outputs(policy, gathered.rows, status, columns, gathered.losses)
    return new_state, StepOutput(metrics=metrics, health=table, aux=parted.aux, info=parted.info)


def outputs(
    policy: OnFailure,
    rows: jax.Array,
    status: jax.Array,
    columns: dict[str, jax.Array],
    losses: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The step's health table (the gathered ``rows`` with the verdict's ``columns``
    and every device's ``status`` written in) and its metrics (the mean loss, under
    ``drop`` over the chunks the step trained on)."""
    table = health.to_table(rows, {**columns, "status": status})
    return table, policy.loss(losses, columns)


def layout_of(
    options: Options, mesh: Mesh, extra_specs: Mapping[str, P], state: TrainState
) -> StateLayout:
    """The layout ``state`` lies in on ``mesh`` (traced: the plan reads its shapes)."""
    if options.shard_state is None:
        return Replicated(options, mesh, extra_specs)
    plan = Plan.of(options, state)
    if not plan.sharded:  # the rule shards no leaf: the replicated step, bit for bit
        return Replicated(options, mesh, extra_specs)
    grid = Grid(mesh, options.replicas)
    kind = ParamShards if options.shard_state == "params" else OptimizerShards
    return kind(options, plan, grid, mesh, extra_specs)


class Step:
    """One variant of the traced step (with or without the heartbeat ``beat``, with or
    without the replica check), its policy picked once, here, from the options.

    Call it on global arrays (``shard_map``: ``step(mesh, extra_specs, state, batch,
    extras)``, the layout read from the state), or map :meth:`per_device` at a stacked
    edge (``pmap``: the replicated layout)."""

    def __init__(self, options: Options, *, beat: Beat | None, check_replicas: bool):
        self.options, self.beat, self.check_replicas = options, beat, check_replicas
        self.policy = policy_of(options)

    def _body(self, layout: StateLayout) -> Any:
        return functools.partial(
            body,
            self.options,
            layout,
            self.policy,
            beat=self.beat,
            check_replicas=self.check_replicas,
        )

    def _finish(
        self, state: TrainState, parted: Parted, view: View
    ) -> tuple[TrainState, StepOutput]:
        return finish(self.options, self.policy, state, parted, view)

    def __call__(
        self,
        mesh: Mesh,
        extra_specs: Mapping[str, P],
        state: TrainState,
        batch: Batch,
        extras: dict[str, Any],
    ) -> Result:
        options = self.options
        prints = self.check_replicas and options.model_parallel > 1
        if prints:
            extra_specs = {**extra_specs, "unit_prints": P(options.axis_name)}
        with global_dims(options, state):  # the body sees blocks: the rule's global answers
            layout = layout_of(self.options, mesh, extra_specs, state)
            if prints:  # each device's own copies, read before the body reslices them
                extras = {**extras, "unit_prints": layout.chip_prints(state)}
            repairs = self.policy.repairs(self.check_replicas)
            return layout.run(
                self._body(layout), self._finish, state, batch, extras, repairs=repairs
            )

    def per_device(self, state: TrainState, batch: Batch, extras: dict[str, Any]) -> Result:
        """One device's whole step, replicated: ``(state, batch, extras) -> (state,
        StepOutput, changed)``."""
        layout = Replicated(self.options)
        return layout.per_device(self._body(layout), self._finish)(state, batch, extras)


__all__ = ["Step", "body", "finish", "layout_of", "outputs"]

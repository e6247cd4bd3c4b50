"""How the state lies on the devices, as the one per-device body
(:func:`jaxstep._src.program._body.body`) sees it: a :class:`StateLayout` says how a device
makes its local part (the parameters gathered for the loss, or whole), how the
gradients are reduced (summed, or reduce-scattered), which leaves have replicas to
compare, and where the update runs (inside the ``shard_map``, or after it on global
arrays) with which view of the state.

:class:`Replicated` is here (every device holds the whole state; ``pmap`` runs the same
layout with the stacked arrays converted at its edge); the sharded layouts
(``shard_state="optimizer"``, ``"params"``; ``replicas`` groups and the padding after an
exclusion are their grid and plan) are in :mod:`jaxstep._src.program._sharded`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import Protocol

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import Batch
from jaxstep._src.core import PyTree
from jaxstep._src.core import StepInfo
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.program._gathered import Gathered
from jaxstep._src.program._gathered import Reduced
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._local import Beat
from jaxstep._src.program._local import Here
from jaxstep._src.program._local import LocalPart
from jaxstep._src.program._local import local_part
from jaxstep._src.program._model import chip_prints
from jaxstep._src.program._options import Options
from jaxstep._src.program._policies import OnFailure
from jaxstep._src.program._reduce import all_reduce
from jaxstep._src.program._verdict import InPlace
from jaxstep._src.program._verdict import View

#: the extras a step reads and never changes (its chunk; under ``model_parallel`` at a
#: replica-check step, each device's fingerprints): they do not go out
INPUT_ONLY = ("chunk", "unit_prints")

#: ``rerun(left_out) -> (grads, model_state)``: a device's work again, its cotangents
#: zeroed when ``left_out`` (a sharded layout's ``drop``); None where no layout needs it
Rerun = Callable[[jax.Array], tuple[PyTree, PyTree]]


class Parted(NamedTuple):
    """What the per-device body hands the update: what the collective gathered (the
    reduced gradients, under a sharded layout a shard of each sharded leaf, the new
    model state, every device's loss, status and row, the step-wide facts), the extras
    it changed, each device's ``aux`` and the step's facts."""

    gathered: Gathered
    extras: dict[str, Any]
    aux: PyTree
    info: StepInfo
    #: the state with every diverged replica repaired (``drop``, at a replica-check
    #: step): what the update must start from; else None
    repaired: TrainState | None = None
    #: where this device stands (inside the ``shard_map``; None once out of it)
    at: Here | None = None


#: ``body(state, batch, extras) -> Parted``: the per-device body, its layout bound
Body = Callable[[TrainState, Batch, dict[str, Any]], Parted]
#: ``finish(state, parted, view) -> (new_state, StepOutput)``: the verdict and the update
Finish = Callable[[TrainState, Parted, View], tuple[TrainState, StepOutput]]
#: ``(state, StepOutput, the extras the step changed)``
Result = tuple[TrainState, StepOutput, dict[str, Any]]


class StateLayout(Protocol):
    """What the per-device body asks of a layout."""

    def replica_view(self, state: TrainState) -> tuple[Sequence[bool] | None, Grid | None]:
        """The leaves of (params, opt_state, model_state) a device holds a shard of and
        the replica groups, as a repair before the local part reads them."""
        ...

    def twins(self, state: TrainState) -> tuple[Sequence[bool] | None, int]:
        """The leaves compared among their twins alone, and the groups."""
        ...

    def chip_prints(self, state: TrainState) -> jax.Array:
        """Under ``model_parallel``: every device's fingerprints of what it holds of
        ``state``, ``(n, m, leaves)``, read on this layout's blocks before the body
        (:func:`~jaxstep._src.program._model.chip_prints`)."""
        ...

    def local_part(
        self,
        policy: OnFailure,
        state: TrainState,
        batch: Batch,
        at: Here,
        *,
        beat: Beat | None,
        check_replicas: bool,
    ) -> tuple[LocalPart, Rerun | None]:
        """This device's part before its gradients are reduced."""
        ...

    def compared_before(self, part: LocalPart) -> LocalPart:
        """``part`` when the replicas were compared (and repaired) before it."""
        ...

    def reduce(
        self,
        policy: OnFailure,
        state: TrainState,
        part: LocalPart,
        at: Here,
        rerun: Rerun | None,
    ) -> Reduced:
        """The step's reduction: what every device holds after it."""
        ...

    def run(
        self,
        body: Body,
        finish: Finish,
        state: TrainState,
        batch: Batch,
        extras: Any,
        *,
        repairs: bool,
    ) -> Result:
        """The whole step on global arrays: ``body`` on every device, then ``finish``
        (``repairs``: ``body`` hands out a repaired state)."""
        ...


class Replicated:
    """Every device holds the whole state (``P()``); the update runs inside the
    ``shard_map``, on each device's copy. ``mesh``, ``extra_specs``: where it is mapped
    (None for ``pmap``, which maps :meth:`per_device` itself)."""

    def __init__(
        self,
        options: Options,
        mesh: Mesh | None = None,
        extra_specs: Mapping[str, P] | None = None,
    ):
        self.options, self.mesh, self.extra_specs = options, mesh, extra_specs

    def replica_view(self, state: TrainState) -> tuple[Sequence[bool] | None, Grid | None]:
        return None, None

    def twins(self, state: TrainState) -> tuple[Sequence[bool] | None, int]:
        return None, 1

    def chip_prints(self, state: TrainState) -> jax.Array:
        return chip_prints(self.options, state)

    def local_part(
        self,
        policy: OnFailure,
        state: TrainState,
        batch: Batch,
        at: Here,
        *,
        beat: Beat | None,
        check_replicas: bool,
    ) -> tuple[LocalPart, Rerun | None]:
        part = local_part(self.options, state, batch, at, beat=beat, check_replicas=check_replicas)
        return part, None

    def compared_before(self, part: LocalPart) -> LocalPart:
        return part._replace(prints=None)

    def reduce(
        self,
        policy: OnFailure,
        state: TrainState,
        part: LocalPart,
        at: Here,
        rerun: Rerun | None,
    ) -> Reduced:
        return all_reduce(self.options, policy, state, part, at)

    def per_device(self, body: Body, finish: Finish) -> Callable[..., Result]:
        """One device's whole step, ``(state, batch, extras) -> (state, StepOutput,
        changed)``: what the ``shard_map`` maps, and ``pmap`` at its stacked edge."""

        def step(state: TrainState, batch: Batch, extras: dict[str, Any]) -> Result:
            parted = body(state, batch, extras)
            start = state if parted.repaired is None else parted.repaired
            assert parted.at is not None  # inside the shard_map
            new_state, out = finish(start, parted, InPlace(self.options, parted.at))
            # only the extras a step changes go out (``fired``): an output chunk cost a copy
            return new_state, out, {k: v for k, v in parted.extras.items() if k not in INPUT_ONLY}

        return step

    def run(
        self,
        body: Body,
        finish: Finish,
        state: TrainState,
        batch: Batch,
        extras: Any,
        *,
        repairs: bool,
    ) -> Result:
        assert self.mesh is not None and self.extra_specs is not None
        mapped = map_body(self.per_device(body, finish), self.options, self.extra_specs)
        return mapped(state, batch, extras)


def map_body(
    body_fn: Callable[..., Result],
    options: Options,
    extra_specs: Mapping[str, P],
) -> Callable[..., Result]:
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

    changed_specs = {k: s for k, s in extra_specs.items() if k not in INPUT_ONLY}  # body's out
    axis = options.axis_name
    return options.on_devices(
        stacked_aux,
        in_specs=(P(), P(axis), dict(extra_specs)),
        out_specs=(P(), StepOutput._make((P(), P(), P(axis), P())), changed_specs),
    )


__all__ = ["Body", "Finish", "Parted", "Replicated", "Rerun", "StateLayout", "map_body"]

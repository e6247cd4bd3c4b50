"""What a step does with a failure (``make_train_step(on_failure=...)``): one small
class per policy, picked once by :func:`policy_of`, whose methods the traced step
calls at the fixed points where the policies differ.

- :class:`Raise`: a failed step freezes the state (``halted``);
- :class:`Skip`: the update is discarded on every device, until
  ``max_consecutive_skips`` failures in a row halt the run;
- :class:`Drop`: a device whose own checks fail is left out of the step's sums (the
  mean over the healthy devices), a diverged replica is repaired before the local
  part, and a device left out ``max_consecutive_drops`` steps in a row halts the run
  (:mod:`jaxstep._src.program._drop` holds its traced parts).

Nothing else in the traced program reads ``on_failure``: a policy's methods hand their
values through where another policy acts, so each program holds its own policy's code
alone.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jaxstep._src.core import COL
from jaxstep._src.core import PyTree
from jaxstep._src.core import Status
from jaxstep._src.core import TrainState
from jaxstep._src.program import _drop as drop
from jaxstep._src.program._gathered import Reduced
from jaxstep._src.program._gathered import Seen
from jaxstep._src.program._grid import Grid
from jaxstep._src.program._options import Options

if TYPE_CHECKING:
    from jaxstep._src.program._local import Here

_SKIPS, _DROPS = COL["consecutive_skips"], COL["consecutive_drops"]  # counters, gathered

#: the failures a device's forward pass tells (a drop leaves it out before any scatter)
FORWARD = int(
    Status.INPUT_NONFINITE
    | Status.LOSS_NONFINITE
    | Status.MODEL_STATE_NONFINITE
    | Status.CHECK_FAILED
)

#: ``redo(left_out, share) -> (grad_sums, model_state)``: a layout's reduction again,
#: with this device left out when ``left_out`` (its float model state divided by ``share``)
Redo = Callable[[jax.Array, Callable[[jax.Array], jax.Array]], tuple[PyTree, PyTree]]


class OnFailure:
    """The policy protocol: each method is a point of the traced step where the
    policies differ, and does here what :class:`Raise` does (hands its value through,
    where it can)."""

    name: str
    #: whether a failing device is left out of the step's sums
    leaves_out = False

    def __init__(self, options: Options):
        self.options = options

    # -- before the local part ----------------------------------------------------

    def repairs(self, check_replicas: bool) -> bool:
        """Whether this variant repairs diverged replicas before the local part."""
        return False

    def repair(
        self,
        state: TrainState,
        at: Here,
        sharded: Sequence[bool] | None,
        grid: Grid | None,
        *,
        check_replicas: bool,
    ) -> tuple[TrainState, drop.Repair | None]:
        """The state with diverged replicas repaired first, and what was found (None:
        not repaired here; the replica check compares the fingerprints after)."""
        return state, None

    # -- the reduction -------------------------------------------------------------

    def forward_keep(self, forward_failed: jax.Array) -> jax.Array:
        """The factor a device's cotangents are scattered with, from what its forward
        pass tells (``shard_state="params"``)."""
        return jnp.ones((), jnp.float32)

    def leave_out(self, bad: jax.Array, tree: PyTree) -> PyTree:
        """``tree`` as a device sends it to the sums (``bad``: it failed its own checks)."""
        return tree

    def summed(self, state: TrainState, failing: jax.Array, index: jax.Array) -> list[jax.Array]:
        """Columns summed over the devices beside the step-wide counts."""
        return []

    def counters(self, state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        """The state's counters a device's row carries to the verdict (gathered in the
        all-reduce: read before it, so XLA updates their donated buffers in place)."""
        return {}

    def gathered(self, rows: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """:meth:`counters` as :class:`Seen` takes them back from the gathered rows:
        (``skips``, ``drops``)."""
        return None, None

    def share(self, failing: jax.Array) -> Callable[[jax.Array], jax.Array]:
        """How a sum over the devices becomes their mean (``failing``: the devices that
        failed their own checks, counted)."""
        n = self.options.n
        return lambda x: x / n

    def rerun(self, reduced: Reduced, index: jax.Array, each: bool, redo: Redo) -> Reduced:
        """A sharded layout's reduction, done again when a device must be left out that
        only its gradients showed (``each``: every micro-batch scattered its own)."""
        return reduced

    # -- the verdict ------------------------------------------------------------------

    def mark(self, seen: Seen, status: jax.Array) -> Seen:
        """The step-wide facts with the devices a failure leaves out."""
        return seen

    def cleared(self, seen: Seen) -> jax.Array:
        """Failures that clear the new parameters of blame (``verify_update``): after a
        bad gradient every replica's update is bad too."""
        return seen.failed

    def failed(self, seen: Seen) -> jax.Array:
        """Whether the step fails as a whole."""
        return seen.failed

    def halt_or_skip(
        self, failed: jax.Array, must_halt: jax.Array, skips: jax.Array, halted: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(halt now, skipped) for a step that ``failed``."""
        return failed, jnp.array(False)

    def decide(
        self, state: TrainState, seen: Seen, ok: jax.Array
    ) -> tuple[jax.Array, dict[str, Any], dict[str, jax.Array]] | None:
        """The policy's own part of the verdict: (a device that halts the run, the new
        state's fields, the table's columns); None: it has none."""
        return None

    def loss(self, losses: jax.Array, columns: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The step's loss metric."""
        return {"loss": jnp.mean(losses)}


class Raise(OnFailure):
    """``on_failure="raise"``: a failed step halts the state; nothing is left out."""

    name = "raise"


class Skip(OnFailure):
    """``on_failure="skip"``: a failed step's update is discarded on every device."""

    name = "skip"

    def counters(self, state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        return {"consecutive_skips": state.consecutive_skips}

    def gathered(self, rows: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        return rows[0, _SKIPS].astype(jnp.int32), None

    def halt_or_skip(
        self, failed: jax.Array, must_halt: jax.Array, skips: jax.Array, halted: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        limit = self.options.max_consecutive_skips
        halt_now = must_halt
        if limit is not None:
            halt_now |= failed & (skips + 1 >= limit)
        return halt_now, failed & ~halt_now & ~halted


class Drop(Skip):
    """``on_failure="drop"``: a failing device is left out of the step's mean; a step
    that leaving devices out cannot cure is skipped as under :class:`Skip`."""

    name = "drop"
    leaves_out = True

    def repairs(self, check_replicas: bool) -> bool:
        return check_replicas

    def repair(
        self,
        state: TrainState,
        at: Here,
        sharded: Sequence[bool] | None,
        grid: Grid | None,
        *,
        check_replicas: bool,
    ) -> tuple[TrainState, drop.Repair | None]:
        if not check_replicas:
            return state, None
        return drop.repair_replicas(self.options, state, at.position, sharded, grid, at.prints)

    def forward_keep(self, forward_failed: jax.Array) -> jax.Array:
        return jnp.where(forward_failed, 0.0, 1.0)

    def leave_out(self, bad: jax.Array, tree: PyTree) -> PyTree:
        return drop.leave_out(bad, tree)

    def summed(self, state: TrainState, failing: jax.Array, index: jax.Array) -> list[jax.Array]:
        limit = self.options.max_consecutive_drops
        if limit is None:
            return []
        # failing again, and max_consecutive_drops times in a row: counted here, in
        # the summed columns, so the verdict needs no reduction over the devices
        drops = state.monitor["drops"][index]
        return [failing & (drops + 1 >= limit)]

    def counters(self, state: TrainState, index: jax.Array) -> dict[str, jax.Array]:
        return {
            **super().counters(state, index),
            "consecutive_drops": state.monitor["drops"][index],
        }

    def gathered(self, rows: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        return super().gathered(rows)[0], rows[:, _DROPS].astype(jnp.int32)

    def share(self, failing: jax.Array) -> Callable[[jax.Array], jax.Array]:
        # times the reciprocal, not divided: a multiply by a scalar fuses into both of
        # the optimizer's passes that read it, where a divide got a pass of its own
        healthy = jnp.maximum(self.options.n - failing, 1)
        return lambda x: times_share(x, healthy)

    def rerun(self, reduced: Reduced, index: jax.Array, each: bool, redo: Redo) -> Reduced:
        status = reduced.status
        left = drop.left_out(status)
        # each micro-batch scattered its own (``each``), or its gradients alone failed
        again = jnp.any(left) if each else jnp.any(left & ((status & FORWARD) == 0))
        again &= (reduced.seen.failing <= self.options.dropped_limit) & ~reduced.seen.halted
        share = self.share(reduced.seen.failing)

        def once_more(_: Any) -> tuple[PyTree, PyTree]:
            return redo(left[index], share)

        def as_reduced(_: Any) -> tuple[PyTree, PyTree]:
            return reduced.grad_sums, reduced.model_state

        grad_sums, model_state = jax.lax.cond(again, once_more, as_reduced, None)
        return reduced._replace(grad_sums=grad_sums, model_state=model_state)

    def mark(self, seen: Seen, status: jax.Array) -> Seen:
        return seen._replace(left_out=drop.left_out(status))

    def cleared(self, seen: Seen) -> jax.Array:
        # the failing devices' gradients are not in the update
        return seen.late  # type: ignore[return-value]

    def failed(self, seen: Seen) -> jax.Array:
        # what leaving the failing devices out cannot cure
        limit = self.options.dropped_limit
        return seen.late | seen.halt | (seen.failing > limit)

    def decide(
        self, state: TrainState, seen: Seen, ok: jax.Array
    ) -> tuple[jax.Array, dict[str, Any], dict[str, jax.Array]] | None:
        bad_device, _, fields, columns = drop.decide(self.options, state, seen, ok)
        return bad_device, fields, columns

    def loss(self, losses: jax.Array, columns: dict[str, jax.Array]) -> dict[str, jax.Array]:
        kept = ~columns["dropped"]  # the mean over the chunks the step trained on
        return {"loss": jnp.sum(jnp.where(kept, losses, 0.0)) / jnp.maximum(jnp.sum(kept), 1)}


def times_share(x: jax.Array, healthy: jax.Array) -> jax.Array:
    """``x / healthy`` as a multiply by the reciprocal, taken in at least float32 and in
    ``x``'s own precision when higher (float64 under x64), rounded to ``x``'s dtype once:
    the counts are float32, so a reciprocal cast to bfloat16 first was off by 0.2%."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    return (x.astype(wide) * (1 / healthy.astype(wide))).astype(x.dtype)


BY_NAME: dict[str, type[OnFailure]] = {"raise": Raise, "skip": Skip, "drop": Drop}


def policy_of(options: Options) -> OnFailure:
    """The step's policy, picked once from ``options.on_failure`` (checked there):
    the one place that reads it."""
    return BY_NAME[options.on_failure](options)


__all__ = ["BY_NAME", "FORWARD", "Drop", "OnFailure", "Raise", "Skip", "policy_of", "times_share"]

"""The compiled programs of one runtime: the step's four variants (with or without the
heartbeat callback, with or without the replica check), each compiled on first use,
their replays (the same step without its new state: what a diagnosis runs), the
variants compiled ahead of time for a shape (``compile``), and the small programs run
beside the step (clearing ``halted``, as a copy or in place; the replica check
alone)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxstep._src.core import TrainState
from jaxstep._src.program import Options
from jaxstep._src.program import Step
from jaxstep._src.program import shard_mask
from jaxstep._src.program import unit_prints
from jaxstep._src.step._backends import Backend

#: ``beat(position, step_number, status) -> status``: the heartbeat callback
Beat = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Programs:
    """What one runtime runs on its devices, compiled on first use.

    Args:
      options: the step's options for these devices.
      backend: how the programs are mapped over the devices.
      split: which of the extras are split over the devices (else replicated).
      beat: the heartbeat callback the heartbeat variants call.
    """

    def __init__(self, options: Options, backend: Backend, split: dict[str, bool], beat: Beat):
        self.options = options
        self.backend = backend
        # The four variants: the heartbeat one (fit(step_timeout=...)) adds a host
        # callback per device, the replica-check one runs only every
        # divergence_every-th step, so the other steps carry none of its cost.
        # Under replicas > 1 the step's program spans two meshes (the state's and the
        # step's: program/_grid.py), where JAX lowers no host callback ("mesh should be
        # the same across the entire program", 0.10): its heartbeat variant carries no
        # beat, and a step that hangs is named by the watchdog as a whole.
        beats = options.replicas == 1
        self.variants = {
            (hb, rc): self._variant(split, beat if hb else None, rc)
            for hb in ((False, True) if beats else (False,))
            for rc in (False, True)
        }
        if not beats:  # the heartbeat variants are the plain ones (compiled once)
            self.variants.update({(True, rc): self.variants[(False, rc)] for rc in (False, True)})
        self._replays: dict[tuple[bool, bool], Any] = {}
        self._ahead: dict[tuple[Any, ...], jax.stages.Compiled] = {}
        self.clear_halt = backend.compile_state_fn(
            lambda s: dataclasses.replace(s, halted=jnp.zeros_like(s.halted))
        )
        # The failure path's: the halted state's buffers become the cleared one's (each
        # output aliases its donated input: no copy; ``halted`` comes in apart, made on
        # the host side with its sharding, so no donated buffer goes unused).
        self._unhalted = jax.jit(
            lambda rest, halted: dataclasses.replace(rest, halted=halted), donate_argnums=0
        )
        self._prints: Callable[[TrainState], jax.Array] | None = None

    def _variant(self, split: dict[str, bool], beat: Beat | None, check_replicas: bool) -> Any:
        """One variant: the one per-device body (:class:`jaxstep._src.program.Step`) over
        the state's layout, compiled by the backend."""
        step = Step(self.options, beat=beat, check_replicas=check_replicas)
        return self.backend.compile(step, self.options.donate, split)

    def replay(self, heartbeat: bool, check_replicas: bool) -> Any:
        """A variant as a replay runs it: ``(state, batch, extras) -> StepOutput``, the
        new state left out. Nothing is donated, so it runs from the state itself (no
        copy), and XLA drops the update the output does not need (all of it but
        ``verify_update``'s check): it holds less than the step. Compiled on first use."""
        key = (heartbeat, check_replicas)
        if key not in self._replays:
            variant = self.variants[key]  # inlined: its donation does not apply here
            self._replays[key] = jax.jit(
                lambda state, batch, extras: variant(state, batch, extras)[1]
            )
        return self._replays[key]

    def ahead(
        self,
        state: TrainState,
        placed: Any,
        extras: Any,
        *,
        heartbeat: bool,
        check_replicas: bool,
        replay: bool = False,
    ) -> jax.stages.Compiled:
        """The variant (``replay``: its replay) compiled ahead for these shapes (cached)."""
        leaves = jax.tree.leaves((state, placed))
        key = (heartbeat, check_replicas, replay, *((x.shape, str(x.dtype)) for x in leaves))
        if key not in self._ahead:
            how = (heartbeat, check_replicas)
            variant = self.replay(*how) if replay else self.variants[how]
            self._ahead[key] = variant.lower(state, placed, extras).compile()
        return self._ahead[key]

    def shards(self, state: TrainState) -> list[bool] | None:
        """The leaves of (params, opt_state, model_state) held as shards of the data
        axis (a sharded layout's); None: none."""
        plan = self.backend.plan(state)
        return None if plan is None else shard_mask(plan, state)

    def twinned(self, state: TrainState) -> list[bool] | None:
        """The leaves of (params, opt_state, model_state) held as shards with twins
        (``replicas > 1``), compared among their twins; None: none."""
        plan = self.backend.plan(state)
        if plan is None or self.options.replicas == 1:
            return None
        return shard_mask(plan, state)

    def unhalted(self, state: TrainState) -> TrainState:
        """``state`` with ``halted`` cleared, in ``state``'s own buffers: ``state`` is
        donated (unusable after), so a failed step's last good state costs no second
        copy."""
        rest = dataclasses.replace(state, halted=None)  # type: ignore[arg-type]
        return self._unhalted(rest, jnp.zeros_like(state.halted))

    def fingerprints(self, state: TrainState) -> np.ndarray:
        """Every device's fingerprints of its copy of ``state``'s params, optimizer state
        and model state, gathered (``(n, leaves)``; a shard without twins left at 0: it
        has no second copy to compare; with twins, its block's). Compiled on first use."""
        if self._prints is None:
            axis = self.options.axis_name
            plan = self.backend.plan(state)
            # a shard without twins (one replica group) has no second copy to compare
            alone = None if plan is None or self.options.replicas > 1 else shard_mask(plan, state)

            def prints(s: TrainState) -> jax.Array:
                return jax.lax.all_gather(unit_prints(self.options, s, alone), axis)

            self._prints = self.backend.compile_state_fn(prints, P())
        gathered = np.asarray(self._prints(state))
        return gathered[0] if self.backend.stacked else gathered

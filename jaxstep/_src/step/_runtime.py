"""A step's runtime on one set of devices: the one object that owns the backend, the
compiled programs, the small arrays threaded through every call, the input checks and
the host's caches, and does everything jaxstep does with a step (the call, the loop's
dispatch with heartbeats, reads of one device's copy, the replica check alone, the
replay diagnosis, the dropping rerun).

A :class:`~jaxstep.TrainStep` is the public face over its current runtime. Leaving
devices out builds a new runtime (:meth:`Runtime.without`) rather than changing this
one, so what holds a runtime (fit's loop and its actions, the prefetch thread, the
watchdog) keeps a consistent one until it is handed the new one."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core import Batch
from jaxstep._src.core import Failure
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import StepInfo
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.core import failures_from_table
from jaxstep._src.core import from_host
from jaxstep._src.core import log
from jaxstep._src.core import processes
from jaxstep._src.core import validate
from jaxstep._src.core import warn
from jaxstep._src.program import Options
from jaxstep._src.program import all_agree
from jaxstep._src.program import minority
from jaxstep._src.step import _exclude as exclude
from jaxstep._src.step import _replay as replays
from jaxstep._src.step._backends import Backend
from jaxstep._src.step._backends import ShardMapBackend
from jaxstep._src.step._backends import owned
from jaxstep._src.step._dropping import Dropping
from jaxstep._src.step._extras import Extras
from jaxstep._src.step._first_state import first_state
from jaxstep._src.step._first_state import padded_leaves
from jaxstep._src.step._first_state import shards_nothing
from jaxstep._src.step._inputs import Inputs
from jaxstep._src.step._inputs import join_presplit
from jaxstep._src.step._inputs import local_positions
from jaxstep._src.step._passes import Passes
from jaxstep._src.step._pmap import PmapBackend
from jaxstep._src.step._programs import Programs

BACKENDS: dict[str, type[Backend]] = {"shard_map": ShardMapBackend, "pmap": PmapBackend}


class Runtime:
    """The step on one set of devices (``options.devices``). Build it from the step's
    options; :meth:`without` builds the runtime on fewer devices.

    Args:
      options: the step's options for these devices.
      inputs: what the state and batch checks learned so far (the leaf names carry
        over to a runtime on fewer devices), or None: a new step.
      origin: the devices the step was built with, once some left (None before).
      fired: which injected faults fired already (a runtime on fewer devices).
    """

    def __init__(
        self,
        options: Options,
        *,
        inputs: Inputs | None = None,
        origin: Sequence[jax.Device] | None = None,
        fired: np.ndarray | None = None,
        heartbeats: dict[int, int] | None = None,
        extras: Extras | None = None,
    ):
        self.options = options
        self.devices: list[jax.Device] = list(options.devices)
        self.origin = None if origin is None else list(origin)
        self.backend: Backend = BACKENDS[options.backend](options)
        self.stacked = self.backend.stacked  # state leaves carry a leading device axis
        self.inputs = Inputs(options) if inputs is None else inputs.for_options(options)
        #: device position -> the last step whose local part it finished, as the
        #: heartbeat programs record them (the loop clears it before a watched step)
        self.heartbeats: dict[int, int] = {} if heartbeats is None else heartbeats
        self.extras = Extras(self.backend, len(options.faults), fired) if extras is None else extras
        self.programs = Programs(options, self.backend, self.extras.split, self._beat)
        #: the diagnosis's passes over one failing chunk, on one device
        self.passes = Passes(options, self.backend)
        self._last_state: TrainState | None = None  # the state dispatched last returned
        self._next_number = 0  # its step number
        self._info: StepInfo | None = None
        self._said: set[str] = set()  # what init said of the layout: each said once
        #: the drop-policy rerun (fit's quarantine), its runtime sharing this one's
        #: fault bookkeeping and heartbeats
        self.dropping = Dropping(
            options,
            self.backend,
            lambda again: Runtime(again, heartbeats=self.heartbeats, extras=self.extras),
        )

    @property
    def names(self) -> dict[str, list[str]]:
        """The leaf names errors use (``TrainStep.names``)."""
        return self.inputs.names

    @property
    def rows_per_device(self) -> int:
        """Rows per device of the batch checked last, as this process passed it."""
        return self.inputs.rows_per_device

    # -- the state ---------------------------------------------------------------

    def init(self, params: Params, model_state: PyTree, rng: jax.Array | None) -> TrainState:
        """``TrainStep.init``: the first state, placed (the caller's arrays are copied:
        the step donates its state)."""
        state = first_state(self.options, self.backend, params, model_state, rng)
        unsharded = shards_nothing(self.options, self.backend, state)
        if unsharded is not None and unsharded not in self._said:
            self._said.add(unsharded)
            warn(unsharded)
        padded = padded_leaves(self.options, self.backend, state)
        if padded is not None and padded not in self._said:
            self._said.add(padded)
            log.warning(padded)
        # A new run: the batch's layout is learned from the next batch (not held to an
        # earlier run's, e.g. a pre-split batch first passed without presplit=True)
        self.inputs.forget()
        placed = self.backend.place_state(state)
        self.inputs.check_state(placed, built=True)  # records the state's shape
        return placed

    def check_state(self, state: Any) -> None:
        """Raises what a call would raise for ``state`` (the state returned last is
        known good: not checked again)."""
        if state is not self._last_state:
            self.inputs.check_state(state)

    def place_state(self, state: TrainState) -> TrainState:
        """A single-copy state (numpy, or another step's ``host_state``) on these devices."""
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a jaxstep.TrainState, got {type(state).__name__}")
        return owned(state, self.backend.place_state(from_host(state)))

    def host_state(self, state: TrainState) -> TrainState:
        """One device's copy of ``state``, as on a single device (``TrainStep.host_state``)."""
        return self.backend.one_replica(state)

    def clear_halt(self, state: TrainState) -> TrainState:
        """``state`` with ``halted`` cleared (a copy)."""
        return self.programs.clear_halt(state)

    def unhalted(self, state: TrainState) -> TrainState:
        """``state`` with ``halted`` cleared in its own buffers (no copy): ``state`` is
        donated, unusable after. The failure path's: the halted state becomes the
        error's last good state, so a diagnosis works beside one copy, not two."""
        self.check_state(state)
        return self.programs.unhalted(state)

    def read_first(self, tree: PyTree) -> PyTree:
        """The numpy copy of ``tree`` held by this process's first device of the step (a
        small read: ``read_first(state.step)``); typed keys as
        :class:`~jaxstep._src.core.HostKey`."""
        return self.backend.read_first(tree)

    def read_at(self, tree: PyTree, position: int) -> PyTree:
        """The numpy copy of ``tree`` held by ``devices[position]``; a leaf sharded over
        the devices comes whole (across processes a collective: every process calls it
        alike)."""
        return self.backend.read_at(tree, position)

    def replicas_agree(self, state: TrainState) -> bool:
        """Whether every device holds the same bits of ``state``'s params, optimizer
        state and model state: the step's replica check, run alone."""
        gathered = self.programs.fingerprints(state)
        return all_agree(gathered, self.programs.twinned(state), self.options.replicas)

    def shards(self, state: TrainState) -> list[bool] | None:
        """Which leaves of ``state``'s (params, optimizer state, model state), in the
        order of ``names["state"]``, are held as shards of the data axis (None: the
        layout shards none)."""
        return self.programs.shards(state)

    def differing(self, state: TrainState) -> dict[int, int]:
        """The positions (in :attr:`devices`) of the devices whose copy of ``state``
        is not a strict majority's (a shard among its twins alone: two twins that differ
        are both named), each with the first leaf of (params, optimizer state, model
        state) where it differs; empty when :meth:`replicas_agree`."""
        gathered = jnp.asarray(self.programs.fingerprints(state))
        bad, first = minority(gathered, self.programs.twinned(state), self.options.replicas)
        return {int(i): int(first[i]) for i in np.flatnonzero(np.asarray(bad))}

    def step_number(self, state: TrainState) -> int:
        """``state.step`` (no device read for the state returned last)."""
        if state is self._last_state:
            return self._next_number
        return int(np.asarray(self.backend.read_first(state.step)))

    # -- the call ----------------------------------------------------------------

    def dispatch(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        presplit: bool = False,
        check_replicas: bool = False,
    ) -> tuple[TrainState, StepOutput]:
        """Calling the step, with what ``fit`` adds: ``heartbeat=True`` also records, in
        :attr:`heartbeats`, each device finishing its local part (a host callback per
        device and step, what ``fit(step_timeout=...)`` uses to name a hung device; on
        CPU such a step runs synchronously); ``check_replicas=True`` runs the replica
        check at this step whatever ``divergence_every`` says (``fit`` does at a
        checkpoint step, so every checkpoint is verified).

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        if presplit:
            self.inputs.presplit_warned = True  # it is pre-split, and said so
            batch = self.join(batch)
        last = state is self._last_state
        if not last:
            self.inputs.check_state(state)
        leaves = self.inputs.check_batch(batch, presplit)
        number = self._next_number if last else self.step_number(state)
        placed = self.backend.place_batch(batch, leaves)
        every = self.options.divergence_every
        check = check_replicas or (every is not None and number % every == 0)
        if heartbeat:
            fn: Callable[..., Any] = self.compile(
                state, batch, heartbeat=True, check_replicas=check
            )
        else:
            fn = self.programs.variants[(False, check)]
        try:  # free when nothing is raised (Python 3.11): no per-shape bookkeeping needed
            state, out, changed = fn(state, placed, self.extras.placed)
        except Exception as err:  # tracing a new shape failed: say if it looks pre-split
            hint = validate.axis_hint(err, self.options.axis_name) or validate.presplit_hint(
                err, batch, len(self.devices)
            )
            if hint is None:
                raise
            raise hint from err
        if changed:  # the faults' bookkeeping (the chunks never change here)
            self.extras.placed = {**self.extras.placed, **changed}
        self._last_state, self._next_number = state, number + 1
        if out.info is not self._info:
            self._info = out.info
            self.inputs.learn_checks(out.info.checks)
        return state, out

    def join(self, batch: Batch) -> Batch:
        """A pre-split ``(n_devices, per_device, ...)`` batch as one batch. Several
        processes: each passes its own rows, ``n_devices`` of them its own devices."""
        return join_presplit(batch, len(local_positions(self.devices)))

    def place_ahead(self, batch: Batch, presplit: bool = False) -> Batch | None:
        """``batch`` placed on the devices and split as the step splits it, ahead of its
        dispatch (fit's prefetch thread): the step takes it without another copy. None:
        nothing to place ahead (a batch already on devices). Raises what
        ``jax.device_put`` raises for a batch the devices cannot take (the step, given
        the batch itself, says why)."""
        if presplit:
            batch = self.join(batch)
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch)):
            return None
        return self.backend.place_batch(batch)

    def compile(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        check_replicas: bool = False,
        replay: bool = False,
    ) -> jax.stages.Compiled:
        """The step (``replay``: its :meth:`replay`, so a watched replay's deadline holds
        no compile time) compiled ahead of time for this state and batch shape (cached)."""
        self.check_state(state)
        self.inputs.check_batch(batch)
        placed = self.backend.place_batch(batch)
        return self.programs.ahead(
            state,
            placed,
            self.extras.placed,
            heartbeat=heartbeat,
            check_replicas=check_replicas,
            replay=replay,
        )

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of the step for this state and batch."""
        placed = self.backend.place_batch(batch)
        return self.programs.variants[(False, False)].lower(state, placed, self.extras.placed)

    def raw_table(self, out: StepOutput) -> np.ndarray:
        """A step's health table as read, undecoded (waits for that step)."""
        return self.backend.read_table(out.health)

    def table(self, out: StepOutput) -> HealthTable:
        """A step's health table, decoded (waits for that step)."""
        return HealthTable.from_array(self.backend.read_table(out.health))

    def failures(self, table: HealthTable, rows_per_device: int | None = None) -> list[Failure]:
        """The failing devices of a step, in device order."""
        # One host needs no host name in every message; many do.
        hosts = processes.host_name if processes.spans_processes(self.devices) else None
        groups = self.options.group_ids if self.options.model_parallel > 1 else None
        return failures_from_table(
            table,
            self.devices,
            self.names,
            rows_per_device,
            self.options.microbatches,
            hosts,
            groups,
        )

    def _beat(self, index: np.ndarray, step_number: np.ndarray, status: np.ndarray) -> np.ndarray:
        self.heartbeats[int(index)] = int(step_number)
        return np.asarray(status, np.int32)

    # -- fewer devices -------------------------------------------------------------

    def without(self, device_ids: Sequence[int], state: TrainState) -> tuple[Runtime, TrainState]:
        """The runtime on the devices left when ``device_ids`` go, and ``state`` on them
        (``TrainStep.exclude_devices`` says what changes; ``_exclude.fewer`` builds
        them). This runtime is unchanged.

        Raises:
          ValueError, TypeError: as ``TrainStep.exclude_devices``; nothing changed.
        """
        self.check_state(state)
        return exclude.fewer(self, device_ids, state)

    def continues(self, state: TrainState, number: int) -> None:
        """``state``, at step ``number``, is the good state the next call starts from
        (known good: not checked again), e.g. a state placed on a new runtime."""
        self._last_state, self._next_number = state, number

    # -- the diagnosis -----------------------------------------------------------

    def replay(
        self,
        state: TrainState,
        batch: Batch,
        *,
        rotation: int = 0,
        order: Sequence[int] | None = None,
        heartbeat: bool = False,
    ) -> StepOutput:
        """The step again from ``state`` with its chunks moved: ``devices[i]`` runs
        chunk ``order[i]`` (by default each process's chunks rotated by ``rotation``
        among its own devices). ``batch``: what the step took (several processes: this
        process's rows). ``heartbeat=True``: its heartbeat variant (compiled ahead), so
        a device that stalls in the replay can be named. Returns the step's output, not
        its new state: the replay runs from ``state`` itself (neither donated nor
        copied), so a diagnosis holds no second copy of the state.

        Raises:
          ValueError: ``order`` is not a permutation of the positions, or gives a
            device a chunk of another process.
        """
        self.check_state(state)
        self.inputs.check_batch(batch)
        chunks = replays.chunk_order(self.devices, rotation, order)
        moved = replays.moved_rows(batch, self.devices, chunks)
        extras = self.extras.with_chunks(chunks)
        placed = self.backend.place_batch(moved)
        every = self.options.divergence_every
        number = self.step_number(state)
        check = every is not None and number % every == 0
        fn: Any = self.programs.replay(False, check)
        if heartbeat:
            fn = self.compile(state, batch, heartbeat=True, check_replicas=check, replay=True)
        out: StepOutput = fn(state, placed, extras)
        self.inputs.learn_checks(out.info.checks)
        return out

    # -- a step again as under on_failure="drop" -----------------------------------

    def rerun_dropping(
        self,
        state: TrainState,
        batch: Batch,
        *,
        presplit: bool = False,
        heartbeat: bool = False,
    ) -> tuple[TrainState, StepOutput]:
        """One step on ``batch`` from ``state`` as a step built with
        ``on_failure="drop"`` would run it, whatever this step's policy (any number of
        devices but all may be left out; no limit on drops in a row; ``halted`` cleared
        first: this reruns a failed step). ``state`` is this step's (its structure in
        and out) and is not donated. Read the output with :meth:`table`:
        ``table.dropped`` marks the devices left out. Injected faults fire as in the
        step itself. Compiled on first use.

        Raises:
          ValueError, TypeError: the state or batch does not fit this step.
        """
        self.check_state(state)
        warned = self.inputs.presplit_warned
        new, out, number = self.dropping.rerun(
            state, batch, presplit=presplit, heartbeat=heartbeat, warned=warned
        )
        self.continues(new, number)
        self.inputs.rows_per_device = self.dropping.sibling().inputs.rows_per_device
        return new, out

    def compile_dropping(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        check_replicas: bool = False,
    ) -> None:
        """:meth:`rerun_dropping`'s program compiled ahead for this state and batch."""
        self.check_state(state)
        entering = self.dropping.entering(state)
        self.dropping.sibling().compile(
            entering, batch, heartbeat=heartbeat, check_replicas=check_replicas
        )

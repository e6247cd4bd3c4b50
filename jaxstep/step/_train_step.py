"""The host driver of the checked step: validate, place, dispatch, compile.

``TrainStep`` holds the compiled per-device program (:mod:`jaxstep.program`) and the
host caches around it; calling it validates the batch (once per shape), places it,
and dispatches one compiled call without waiting for the devices. What jaxstep's
other layers do with a step beyond this face (the loop's dispatch with heartbeats,
reading one device's copy, the replay diagnosis, the dropping rerun) is in
:mod:`jaxstep.step.driving`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep.core import Batch
from jaxstep.core import Failure
from jaxstep.core import HealthTable
from jaxstep.core import Params
from jaxstep.core import PyTree
from jaxstep.core import StepInfo
from jaxstep.core import StepOutput
from jaxstep.core import TrainState
from jaxstep.core import failures_from_table
from jaxstep.core import from_host
from jaxstep.core import processes
from jaxstep.core import validate
from jaxstep.program import Options
from jaxstep.program import body
from jaxstep.program import drop_memory
from jaxstep.program import sharded_step
from jaxstep.step import _exclude as exclude
from jaxstep.step._backends import Backend
from jaxstep.step._backends import Layout
from jaxstep.step._backends import ShardMapBackend
from jaxstep.step._inputs import Inputs
from jaxstep.step._inputs import join_presplit
from jaxstep.step._inputs import local_positions
from jaxstep.step._passes import Passes
from jaxstep.step._pmap import PmapBackend

BACKENDS: dict[str, type[Backend]] = {"shard_map": ShardMapBackend, "pmap": PmapBackend}


class TrainStep:
    """A compiled, checked training step. Build it with :func:`make_train_step`.

    Its face: ``init``, calling it, ``table``, ``failures``, ``clear_halt``,
    ``exclude_devices``; ``check_state``, ``host_state``, ``place_state`` (moving a
    state between steps); ``compile`` / ``lower`` (ahead of time, memory analysis);
    and what it was built with: ``options`` (every option, one
    :class:`~jaxstep.program.Options`: ``step.options.backend``, ``.loss_fn``, ...),
    ``devices``, ``names``. What jaxstep's own layers do with a step beyond that is
    in :mod:`jaxstep.step.driving` (functions taking the step)."""

    def __init__(self, options: Options):
        #: device position -> the last step whose local part it finished, recorded by
        #: the heartbeat programs (``driving.heartbeats``)
        self._heartbeats: dict[int, int] = {}
        #: the devices the step was built with, once ``exclude_devices`` took some out
        #: (``driving.origin``)
        self._origin: list[jax.Device] | None = None
        self._build(options)
        # The state and batch it takes, and their leaf names (``names``).
        self._inputs = Inputs(options)
        self.names = self._inputs.names

    def _build(self, options: Options) -> None:
        """Everything that follows from the options and their device list: the backend,
        the compiled programs (compiled on first use), the fault bookkeeping and the
        caches. Run when the step is built, and again by :meth:`exclude_devices`."""
        self.options = options
        self.devices: list[jax.Device] = list(options.devices)
        layout = None
        if options.shard_state is not None:
            layout = Layout(options.shard_state, options.shard_min_size)
        self._backend: Backend = BACKENDS[options.backend](self.devices, options.axis_name, layout)
        self._injector = options.injector
        # Small arrays threaded through every call: the chunk each device holds (a
        # replay moves them; the random keys follow), and the faults' bookkeeping.
        self._split = {"chunk": True, **({"fired": False} if self._injector else {})}
        self._extras = self._make_extras(np.arange(len(self.devices)))
        # Four programs, compiled on first use: with or without the heartbeat callback,
        # and with or without the replica check, which runs only every
        # divergence_every-th step so the other steps carry none of its cost.
        self._compiled = {
            (hb, rc): self._compile(options, beat=self._beat if hb else None, replicas=rc)
            for hb in (False, True)
            for rc in (False, True)
        }
        self._next_number = 0  # the step number of the state returned last
        self._clear_halt = self._backend.compile_state_fn(
            lambda s: dataclasses.replace(s, halted=jnp.zeros_like(s.halted))
        )
        self._aot: dict[tuple[Any, ...], jax.stages.Compiled] = {}
        self._info: StepInfo | None = None
        self._last_state: TrainState | None = None
        self._fingerprints: Any = None  # driving.replicas_agree's program
        # What driving runs beside the step, for these devices: the diagnosis passes and
        # the dropping step (built on first use); the heartbeats' positions start afresh.
        self._passes = Passes(options, len(self.devices))
        self._dropping: TrainStep | None = None
        self._heartbeats.clear()

    def _compile(self, options: Options, *, beat: Any, replicas: bool) -> Any:
        """One of the step's programs (compiled on first use): the per-device body
        mapped by the backend, or under ``shard_state`` the sharded step, whose
        ``shard_map`` is its own."""
        if options.shard_state is not None:
            step = functools.partial(sharded_step, options, beat=beat, replicas=replicas)
            return self._backend.compile_sharded(step, options.donate, self._split)
        return self._backend.compile(
            functools.partial(body, options, beat=beat, replicas=replicas),
            options.donate,
            self._split,
        )

    def __repr__(self) -> str:
        return f"TrainStep({self.options.summary()})"

    def init(
        self, params: Params, *, model_state: PyTree = None, rng: jax.Array | None = None
    ) -> TrainState:
        """Builds the first state from ``params`` and places it on the devices.

        Args:
          params: a pytree of float arrays.
          model_state: the model's non-trained variables (e.g. linen's
            ``{"batch_stats": ...}``), or None. With it, ``loss_fn`` is called with
            ``model_state=`` and returns the new one in ``aux["model_state"]``.
          rng: optional PRNG key; then ``loss_fn(params, batch, rng)`` gets a key per
            step and device.

        Raises:
          TypeError: a parameter leaf is not a float array, ``rng`` is not a PRNG key,
            or a model state is given to a step built without ``has_aux=True``.
          ValueError: ``params`` is empty or holds non-finite values.
        """
        validate.params(params)
        validate.trainable(params)
        validate.not_variables(params)
        if rng is not None:
            validate.key(rng)
        if model_state is not None:
            validate.model_state_leaves(model_state, self.options.has_aux)
            model_state = jax.tree.map(lambda x: jnp.array(x, copy=True), model_state)
        if self.options.shard_state is None:
            # Own copies: the step donates its state, and must not delete the caller's arrays.
            params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
            opt_state = self.options.optimizer.init(params)
        else:  # placed shard by shard, never whole on one device
            params, opt_state = self._backend.init_sharded(self.options.optimizer, params)
        n = len(self.devices)
        # A new run: the state's names and shape are learned below, the batch's layout from
        # the next batch (not held to an earlier run's, e.g. a pre-split batch first
        # passed without presplit=True)
        self._inputs.forget()
        drops = self.options.on_failure == "drop"
        monitor: dict[str, Any] = {}
        if self.options.loss_spike:
            monitor["spike"] = self.options.loss_spike.init(n)
        if drops:
            monitor |= drop_memory(n)
        # Distinct arrays for every leaf: a donated buffer may appear only once.
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=None if rng is None else jnp.array(rng, copy=True),
            halted=jnp.zeros((), bool),
            consecutive_skips=jnp.zeros((), jnp.int32),
            total_skips=jnp.zeros((), jnp.int32),
            monitor=monitor,
            model_state=model_state,
            loss_scale=None if self.options.loss_scale is None else self.options.loss_scale.init(),
            total_drops=jnp.zeros((), jnp.int32) if drops else None,
        )
        placed = self._backend.place_state(state)
        self._inputs.check_state(placed, built=True)  # records the state's shape
        return placed

    def __call__(
        self, state: TrainState, batch: Batch, *, presplit: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Runs one step on ``batch``; chunk i of its leading axis runs on ``devices[i]``.
        ``presplit=True``: every leaf is ``(n_devices, per_device, ...)``, as pmap code
        builds batches (``[i]`` runs on ``devices[i]``).

        Dispatches and returns at once: nothing here waits for the devices. A failed
        step returns the state unchanged (with ``halted`` set under ``raise``); read
        ``step.table(out)`` or use :func:`jaxstep.fit` to raise the error.

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        return self._dispatch(state, batch, presplit=presplit)

    def _dispatch(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        presplit: bool = False,
        check_replicas: bool = False,
    ) -> tuple[TrainState, StepOutput]:
        """Calling the step, with what ``fit`` adds (:func:`jaxstep.step.driving.dispatch`,
        which is this method: the loop's call pays for no wrapper). ``heartbeat=True``
        also records, in ``driving.heartbeats(step)``, each device finishing its local part
        (a host callback per device and step: what ``fit(step_timeout=...)`` uses to name
        a hung device). On CPU a step with host callbacks runs synchronously.
        ``check_replicas=True`` runs the replica check at this step whatever
        ``divergence_every`` says (what ``fit`` does at a checkpoint step, so every
        checkpoint is verified). ``presplit``: as when calling the step.

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        if presplit:
            self._inputs.presplit_warned = True  # it is pre-split, and said so
            batch = self._join(batch)
        self._check_state(state)
        leaves = self._inputs.check_batch(batch, presplit)
        number = self._step_number(state)
        placed = self._backend.place_batch(batch, leaves)
        replicas = check_replicas or self._checks_replicas(number)
        fn: Callable[..., Any]
        if heartbeat:
            fn = self.compile(state, batch, heartbeat=True, replicas=replicas)
        else:
            fn = self._compiled[(False, replicas)]
        try:  # free when nothing is raised (Python 3.11): no per-shape bookkeeping needed
            state, out, changed = fn(state, placed, self._extras)
        except Exception as err:  # tracing a new shape failed: say if it looks pre-split
            hint = validate.axis_hint(err, self.options.axis_name) or validate.presplit_hint(
                err, batch, len(self.devices)
            )
            if hint is None:
                raise
            raise hint from err
        if changed:  # the faults' bookkeeping (the chunks never change here)
            self._extras = {**self._extras, **changed}
        self._last_state, self._next_number = state, number + 1
        if out.info is not self._info:
            self._learn(out.info)
        return state, out

    def _join(self, batch: Batch) -> Batch:
        """A pre-split ``(n_devices, per_device, ...)`` batch as one batch. Several
        processes: each passes its own rows, ``n_devices`` of them its own devices."""
        return join_presplit(batch, len(local_positions(self.devices)))

    def _learn(self, info: StepInfo) -> None:
        """What the program returned about itself (once per compiled program)."""
        self._info = info
        self._inputs.learn_checks(info.checks)

    def compile(
        self, state: TrainState, batch: Batch, *, heartbeat: bool = False, replicas: bool = False
    ) -> jax.stages.Compiled:
        """Compiles the step ahead of time for this state and batch shape (cached), to
        keep compile time out of a timeout or to read ``memory_analysis()``.
        ``replicas=True``: the variant that runs every ``divergence_every``-th step."""
        self._check_state(state)
        self._inputs.check_batch(batch)
        leaves = jax.tree.leaves((state, batch))
        key = (heartbeat, replicas, *((x.shape, str(x.dtype)) for x in leaves))
        if key not in self._aot:
            placed = self._backend.place_batch(batch)
            fn = self._compiled[(heartbeat, replicas)]
            self._aot[key] = fn.lower(state, placed, self._extras).compile()
        return self._aot[key]

    def _step_number(self, state: TrainState) -> int:
        """``state.step`` without a device read for the state this step returned last."""
        if state is self._last_state:
            return self._next_number
        return int(self._backend.read_first(state.step))

    def _checks_replicas(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the replica check (the variant compiled
        for every ``divergence_every``-th step)."""
        every = self.options.divergence_every
        return every is not None and step_number % every == 0

    def table(self, out: StepOutput) -> HealthTable:
        """Reads a step's health table on the host (waits for that step)."""
        return HealthTable.from_array(self._backend.read_table(out.health))

    def failures(self, table: HealthTable, rows_per_device: int | None = None) -> list[Failure]:
        """The failing devices of a step, in device order."""
        # One host needs no host name in every message; many do.
        hosts = processes.host_name if processes.spans_processes(self.devices) else None
        return failures_from_table(
            table, self.devices, self.names, rows_per_device, self.options.microbatches, hosts
        )

    def clear_halt(self, state: TrainState) -> TrainState:
        """The same state with ``halted`` cleared, to resume from a failed step."""
        return self._clear_halt(state)

    def exclude_devices(self, device_ids: Sequence[int], state: TrainState) -> TrainState:
        """Goes on without the devices ``device_ids`` (``jax.Device.id`` s): this step,
        in place, runs from now on the others, in the same order, and the state returned
        is ``state`` on them, ready for every method of the step.

        The state is rebuilt from the copy of the first remaining device this process
        holds (one read of it; the devices that go are never read), ``halted`` cleared,
        and the per-device columns of its monitor (the loss-spike window, the drop
        policy's counts) kept for the remaining devices. Each batch from now on splits
        over ``len(step.devices)`` devices: its leading axis must divide by the new
        count. Injected faults keep their devices (a fault on a device that goes never
        fires; a transient that fired does not fire again); an explicit
        ``max_dropped`` is lowered to the new count minus one where it must be. The
        compiled programs are compiled again on first use. With several processes,
        every process calls it with the same ids. Under ``shard_state`` the state is
        sharded again by the same rule over the devices left (a warning names the
        bytes per device when leaves that were sharded no longer divide).

        Args:
          device_ids: the ids of the devices to leave out, from ``step.devices``.
          state: a good state of this step (the state passed in is not donated).

        Returns:
          The state on the remaining devices.

        Raises:
          ValueError: an id is not one of the step's devices, or no device would
            remain, or (several processes) a process would keep none of its devices;
            the step is unchanged.
          TypeError: ``device_ids`` is not a sequence of ints.
        """
        keep = exclude.kept_positions(self.options, device_ids)
        options, kept_faults = exclude.smaller_options(self.options, keep)
        self._check_state(state)
        here = jax.process_index()  # a copy this process holds, of a device that stays
        source = next(i for i in keep if self.devices[i].process_index == here)
        host = exclude.shrink_state(self._backend.read_at(state, source), keep)
        exclude.warn_resharded(options, host, len(self.devices))
        fired = None
        if self._injector:
            fired = np.asarray(self._backend.read_first(self._extras["fired"]))[kept_faults]
        if self._origin is None:
            self._origin = list(self.devices)
        self._build(options)
        self._extras = self._make_extras(np.arange(len(self.devices)), fired)
        self._inputs = self._inputs.for_options(options)
        placed = self._backend.place_state(from_host(host))
        self._inputs.check_state(placed, built=True)  # learns the new state's shapes
        self._last_state, self._next_number = placed, int(host.step)
        return placed

    def host_state(self, state: TrainState) -> TrainState:
        """One device's copy of the state, as on a single device (drops pmap's axis)."""
        return self._backend.one_replica(state)

    def place_state(self, state: TrainState) -> TrainState:
        """Places a single-copy state (numpy, another step's ``host_state``, or one
        device's copy: ``driving.local_copy``) on this step's devices: replicated, or stacked under
        ``pmap``. How a state moves between steps, device counts and backends."""
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a jaxstep.TrainState, got {type(state).__name__}")
        return self._backend.place_state(from_host(state))

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of the step for this state and batch (for HLO and
        memory analysis)."""
        placed = self._backend.place_batch(batch)
        return self._compiled[(False, False)].lower(state, placed, self._extras)

    def _make_extras(self, chunks: np.ndarray, fired: np.ndarray | None = None) -> dict[str, Any]:
        values: dict[str, np.ndarray] = {"chunk": np.asarray(chunks, np.int32)}
        if self._injector:
            values["fired"] = np.zeros(len(self._injector.faults), bool) if fired is None else fired
        return self._backend.place_extras(values, self._split)

    def check_state(self, state: TrainState) -> None:
        """Raises the error a step would raise for ``state`` (not a TrainState, donated
        by an earlier call, placed for the other backend or on other devices, built for
        another optimizer or other params), without running anything."""
        self._check_state(state)

    def _check_state(self, state: Any) -> None:
        if state is not self._last_state:  # the state this step returned last: checked
            self._inputs.check_state(state)

    def _beat(self, index: np.ndarray, step_number: np.ndarray, status: np.ndarray) -> np.ndarray:
        self._heartbeats[int(index)] = int(step_number)
        return np.asarray(status, np.int32)

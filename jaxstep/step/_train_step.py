"""The host driver of the checked step: validate, place, dispatch, compile, replay.

``TrainStep`` holds the compiled per-device program (:mod:`jaxstep.program`) and the
host caches around it; calling it validates the batch (once per shape), places it,
and dispatches one compiled call without waiting for the devices.
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
import optax

from jaxstep.core import BackendName
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
from jaxstep.program import fingerprint
from jaxstep.step import _exclude as exclude
from jaxstep.step._backends import BACKENDS
from jaxstep.step._backends import Backend
from jaxstep.step._inputs import Inputs
from jaxstep.step._inputs import join_presplit
from jaxstep.step._passes import Passes


class TrainStep:
    """A compiled, checked training step. Build it with :func:`make_train_step`.

    Its face: ``init``, calling it (``dispatch``), ``table``, ``failures``,
    ``replay``, ``clear_halt``, ``exclude_devices``, ``compile`` / ``lower``; moving
    states: ``host_state``, ``place_state``, ``local_copy``, ``first_copy``, ``join``;
    and what it was built with: ``options`` (every option, one
    :class:`~jaxstep.program.Options`), ``devices``, ``backend``, ``axis_name``,
    ``loss_fn``, ``optimizer``, ``has_aux``, ``stacked``, ``names``. What only
    jaxstep's loop reads sits in ``step._internals``."""

    def __init__(self, options: Options):
        self._build(options)
        self._internals = Internals(self)
        # The state and batch it takes, and their leaf names (``names``).
        self._inputs = Inputs(options)
        self.names = self._inputs.names

    def _build(self, options: Options) -> None:
        """Everything that follows from the options and their device list: the backend,
        the compiled programs (compiled on first use), the fault bookkeeping and the
        caches. Run when the step is built, and again by :meth:`exclude_devices`."""
        self.options = options
        self.devices: list[jax.Device] = list(options.devices)
        self._backend: Backend = BACKENDS[options.backend](self.devices, options.axis_name)
        self._injector = options.injector
        # Small arrays threaded through every call: the chunk each device holds (a
        # replay moves them; the random keys follow), and the faults' bookkeeping.
        self._split = {"chunk": True, **({"fired": False} if self._injector else {})}
        self._extras = self._make_extras(np.arange(len(self.devices)))
        # Four programs, compiled on first use: with or without the heartbeat callback,
        # and with or without the replica check, which runs only every
        # divergence_every-th step so the other steps carry none of its cost.
        self._compiled = {
            (hb, rc): self._backend.compile(
                functools.partial(body, options, beat=self._beat if hb else None, replicas=rc),
                options.donate,
                self._split,
            )
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
        self._fingerprints: Any = None  # replicas_agree's program

    def __repr__(self) -> str:
        o = self.options
        ids = [d.id for d in self.devices]
        shown = ids if len(ids) <= 8 else [*ids[:4], "...", *ids[-2:]]
        parts = [
            f"backend={o.backend!r}",
            f"devices={len(ids)} {shown} ({self.devices[0].platform})",
            f"on_failure={o.on_failure!r}",
            f"axis_name={o.axis_name!r}",
            f"divergence_every={o.divergence_every}",
        ]
        optional = {
            "microbatches": o.microbatches if o.microbatches != 1 else None,
            "loss_spike": o.loss_spike,
            "loss_scale": o.loss_scale,
            "verify_update": o.verify_update or None,
            "faults": len(o.faults) or None,
            "max_consecutive_skips": o.max_consecutive_skips if o.on_failure == "skip" else None,
        }
        parts += [f"{k}={v!r}" for k, v in optional.items() if v is not None]
        name = getattr(o.loss_fn, "__name__", type(o.loss_fn).__name__)
        return f"TrainStep({name}, {', '.join(parts)})"

    @property
    def loss_fn(self) -> Callable[..., Any]:
        """The loss function the step differentiates."""
        return self.options.loss_fn

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """The optax transformation the step applies to the mean gradient."""
        return self.options.optimizer

    @property
    def has_aux(self) -> bool:
        """Whether ``loss_fn`` returns ``(loss, aux)``."""
        return self.options.has_aux

    @property
    def backend(self) -> BackendName:
        """``"shard_map"`` or ``"pmap"``."""
        return self.options.backend

    @property
    def axis_name(self) -> str:
        """The device axis's name, bound for ``loss_fn``'s collectives."""
        return self.options.axis_name

    @property
    def stacked(self) -> bool:
        """Whether state leaves carry a leading device axis (the ``pmap`` backend)."""
        return self._backend.stacked

    # ---------------------------------------------------------------- host side
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
            validate.model_state_leaves(model_state, self.has_aux)
            model_state = jax.tree.map(lambda x: jnp.array(x, copy=True), model_state)
        # Own copies: the step donates its state, and must not delete the caller's arrays.
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        opt_state = self.optimizer.init(params)
        n = len(self.devices)
        self._inputs.forget_state()  # _check_state below learns the new state's names and shape
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
        return self.dispatch(state, batch, presplit=presplit)

    def dispatch(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        presplit: bool = False,
        check_replicas: bool = False,
    ) -> tuple[TrainState, StepOutput]:
        """Like calling the step; ``heartbeat=True`` also records, in
        ``step._internals.heartbeats``, each device finishing its local part (a host callback
        per device and step: what ``fit(step_timeout=...)`` uses to name a hung device).
        On CPU a step with host callbacks runs synchronously. ``check_replicas=True``
        runs the replica check at this step whatever ``divergence_every`` says (what
        ``fit`` does at a checkpoint step, so every checkpoint is verified)."""
        if presplit:
            self._inputs.presplit_warned = True  # it is pre-split, and said so
            batch = self.join(batch)
        self._check_state(state)
        leaves = self._inputs.check_batch(batch)
        number = self._step_number(state)
        placed = self._backend.place_batch(batch, leaves)
        replicas = check_replicas or self._checks_replicas(number)
        fn: Callable[..., Any]
        if heartbeat:
            fn = self.compile(state, batch, heartbeat=True, replicas=replicas)
        else:
            fn = self._compiled[(False, replicas)]
        try:  # free when nothing is raised (Python 3.11): no per-shape bookkeeping needed
            state, out, self._extras = fn(state, placed, self._extras)
        except Exception as err:  # tracing a new shape failed: say if it looks pre-split
            hint = validate.axis_hint(err, self.axis_name) or validate.presplit_hint(
                err, batch, len(self.devices)
            )
            if hint is None:
                raise
            raise hint from err
        self._last_state, self._next_number = state, number + 1
        if out.info is not self._info:
            self._learn(out.info)
        return state, out

    def join(self, batch: Batch) -> Batch:
        """A pre-split ``(n_devices, per_device, ...)`` batch as one batch. Several
        processes: each passes its own rows, ``n_devices`` of them its own devices."""
        return join_presplit(batch, len(self._local_positions()))

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
            self._aot[key] = fn.lower(state, placed, self._extras).compile()  # type: ignore[attr-defined]
        return self._aot[key]

    def _step_number(self, state: TrainState) -> int:
        """``state.step`` without a device read for the state this step returned last."""
        if state is self._last_state:
            return self._next_number
        return int(self.first_copy(state.step))

    def _checks_replicas(self, step_number: int) -> bool:
        """Whether step ``step_number`` runs the replica check (the variant compiled
        for every ``divergence_every``-th step)."""
        every = self.options.divergence_every
        return every is not None and step_number % every == 0

    def replay(
        self,
        state: TrainState,
        batch: Batch,
        *,
        rotation: int = 0,
        order: Sequence[int] | None = None,
    ) -> tuple[TrainState, StepOutput]:
        """Runs the step again from ``state`` (not donated) with its chunks moved:
        ``devices[i]`` runs chunk ``order[i]`` of the global batch. By default each
        process's chunks are rotated by ``rotation`` among its own devices
        (:func:`jaxstep.distributed.local_rotation`): with one process, chunk ``(i +
        rotation) % n`` runs on ``devices[i]``. ``batch`` is what the step took (with
        several processes, this process's rows). Used by :func:`jaxstep.diagnose`.

        Raises:
          ValueError: ``order`` is not a permutation of the device positions, or (several
            processes) gives a device a chunk of another process, whose rows are not here.
        """
        self._check_state(state)
        self._inputs.check_batch(batch)
        if order is None:
            chunks = processes.local_rotation(self.devices, rotation)
        else:
            chunks = self._replay_order(order)
        local = self._local_positions()
        at = {p: j for j, p in enumerate(local)}  # position -> its chunk in this batch
        size = jax.tree.leaves(batch)[0].shape[0] // len(local)  # checked just above
        source = np.asarray([at[int(chunks[p])] for p in local], np.int64)
        rows = (source[:, None] * size + np.arange(size)[None, :]).reshape(-1)
        moved = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
        copy = jax.tree.map(jnp.copy, state)
        extras = dict(self._extras)
        extras["chunk"] = self._make_extras(chunks)["chunk"]
        placed = self._backend.place_batch(moved)
        fn = self._compiled[(False, self._checks_replicas(self._step_number(state)))]
        new_state, out, _ = fn(copy, placed, extras)
        self._learn(out.info)
        return new_state, out

    def _replay_order(self, order: Sequence[int]) -> np.ndarray:
        """``order`` checked: a permutation of the positions that keeps every chunk on a
        device of its own process."""
        n = len(self.devices)
        chunks = np.asarray(order)
        if chunks.shape != (n,) or sorted(chunks.tolist()) != list(range(n)):
            raise ValueError(
                f"replay order must be a permutation of the {n} device positions 0..{n - 1} "
                f"(order[i]: the chunk devices[i] runs), got {list(order)!r}"
            )
        crossing = [
            i
            for i, c in enumerate(chunks.tolist())
            if self.devices[c].process_index != self.devices[i].process_index
        ]
        if crossing:
            i = crossing[0]
            raise ValueError(
                f"replay order gives device {self.devices[i].id} (process "
                f"{self.devices[i].process_index}) chunk {int(chunks[i])}, whose rows process "
                f"{self.devices[int(chunks[i])].process_index} holds: each process passes "
                "only its own rows, so a chunk moves only among its process's devices "
                "(jaxstep.distributed.local_rotation)"
            )
        return chunks

    def _local_positions(self) -> list[int]:
        """The positions whose chunks this process's batches hold, in order: every one
        with one process."""
        if processes.spans_processes(self.devices):
            return processes.local_positions(self.devices)
        return list(range(len(self.devices)))

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
        every process calls it with the same ids.

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
        host = exclude.shrink_state(self.local_copy(state, source), keep)
        fired = None
        if self._injector:
            fired = np.asarray(self._backend.read_first(self._extras["fired"]))[kept_faults]
        inputs = self._inputs
        if self._internals.origin is None:
            self._internals.origin = list(self.devices)
        self._build(options)
        self._extras = self._make_extras(np.arange(len(self.devices)), fired)
        self._internals.rebuild()
        self._inputs = Inputs(options)
        self._inputs.names = self.names  # the same names: the model did not change
        self._inputs.presplit_warned = inputs.presplit_warned
        self._inputs.rows_per_device = inputs.rows_per_device
        placed = self._backend.place_state(from_host(host))
        self._inputs.check_state(placed, built=True)  # learns the new state's shapes
        self._last_state, self._next_number = placed, int(host.step)
        return placed

    def first_copy(self, tree: PyTree) -> PyTree:
        """The numpy copy of ``tree`` held by this process's first device of the step
        (a small read: e.g. ``step.first_copy(state.step)``); typed keys come as
        :class:`jaxstep.core.HostKey`."""
        return self._backend.read_first(tree)

    def host_state(self, state: TrainState) -> TrainState:
        """One device's copy of the state, as on a single device (drops pmap's axis)."""
        return self._backend.one_replica(state)

    def place_state(self, state: TrainState) -> TrainState:
        """Places a single-copy state (numpy, another step's ``host_state``, or a
        :func:`local_copy`) on this step's devices: replicated, or stacked under
        ``pmap``. How a state moves between steps, device counts and backends."""
        if not isinstance(state, TrainState):
            raise TypeError(f"expected a jaxstep.TrainState, got {type(state).__name__}")
        return self._backend.place_state(from_host(state))

    def local_copy(self, tree: PyTree, position: int) -> PyTree:
        """The numpy copy of a replicated (or pmap-stacked) ``tree`` held by
        ``devices[position]``; typed PRNG keys come as :class:`jaxstep.core.HostKey`
        (:meth:`place_state` takes them back)."""
        return self._backend.read_at(tree, position)

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of the step for this state and batch (for HLO and
        memory analysis)."""
        placed = self._backend.place_batch(batch)
        return self._compiled[(False, False)].lower(state, placed, self._extras)  # type: ignore[attr-defined]

    def replicas_agree(self, state: TrainState) -> bool:
        """Whether every device holds the same bits of ``state``'s params, optimizer
        state and model state: the replica check of the step, run alone (one small
        program: each device's fingerprint, gathered; compiled on first use)."""
        if self._fingerprints is None:
            axis = self.axis_name

            def prints(s: TrainState) -> jax.Array:
                mine = fingerprint(jax.tree.leaves((s.params, s.opt_state, s.model_state)))
                return jax.lax.all_gather(mine, axis)

            self._fingerprints = self._backend.compile_state_fn(prints)
        gathered = np.asarray(self._fingerprints(state))
        if self.stacked:
            gathered = gathered[0]
        return bool(np.all(gathered == gathered[:1]))

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
        self._internals.heartbeats[int(index)] = int(step_number)
        return np.asarray(status, np.int32)


class Internals:
    """What jaxstep's own upper layers read of a :class:`TrainStep` and users do not
    call (``step._internals``): the heartbeats of ``fit(step_timeout=...)``, the rows
    per device of the batch dispatched last, the replay diagnosis's two passes over
    one failing chunk, and the rerun of a step as under ``on_failure="drop"``
    (``fit(recover=...)``'s quarantine). Kept off the step's face, in one named place."""

    def __init__(self, step: TrainStep):
        self._step = step
        #: device position -> last step whose local part it finished (heartbeat mode).
        self.heartbeats: dict[int, int] = {}
        #: the devices the step was built with, once ``exclude_devices`` took some out
        #: (None before): a later fit call trains batches laid out for them
        self.origin: list[jax.Device] | None = None
        self.rebuild()

    def rebuild(self) -> None:
        """Starts afresh for the step's (new) devices: the diagnosis passes, the
        heartbeats (positions), the dropping step of :meth:`rerun_dropping`."""
        step = self._step
        self._passes = Passes(step.options, len(step.devices))
        self.heartbeats.clear()
        self._dropping: TrainStep | None = None

    def rerun_dropping(
        self, state: TrainState, batch: Batch, *, presplit: bool = False, heartbeat: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Runs one step on ``batch`` from ``state`` as a step built with
        ``on_failure="drop"`` would, whatever this step's policy: each device whose own
        checks fail (non-finite input, loss, gradient or model state, a user check) is
        left out of the step's mean, and the update is the mean over the others'
        chunks. Any number of devices but all may be left out (all failing: the step
        is skipped, as under ``skip``), with no limit on drops in a row; a failure found
        after the all-reduce (a loss spike) skips it whole. ``halted`` is cleared first:
        this reruns a failed step.

        ``state`` is this step's (its structure in and out: the drop policy's fields,
        ``total_drops`` and ``monitor["drops"]`` / ``["repairs"]``, are added and let
        go on the host, reading nothing; under ``on_failure="drop"`` they are kept). It
        is not donated. Read the output with ``step.table(out)``: ``table.dropped``
        marks the devices left out. Injected faults fire as in the step itself (a
        ``"data"`` fault again on its chunk; a transient that fired does not). The
        dropping step is compiled on first use (and again after
        :meth:`TrainStep.exclude_devices`). ``heartbeat=True`` runs its heartbeat
        variant, as ``TrainStep.dispatch`` does: each device's beat lands in
        :attr:`heartbeats`, as the step's own would (``fit(step_timeout=...)`` names a
        device that stalls in the rerun); :meth:`compile_dropping` compiles it ahead.

        Raises:
          ValueError, TypeError: the state or batch does not fit this step.
        """
        step = self._step
        step.check_state(state)
        own = step.options.on_failure == "drop"
        dropping = self._sibling()
        try:
            new, out = dropping.dispatch(
                self._entering(state), batch, presplit=presplit, heartbeat=heartbeat
            )
        finally:
            step._extras = dropping._extras
        leaving = exclude.out_of_dropping(new, own=own)
        step._last_state, step._next_number = leaving, dropping._next_number
        step._inputs.rows_per_device = dropping._inputs.rows_per_device
        return leaving, out

    def compile_dropping(
        self, state: TrainState, batch: Batch, *, heartbeat: bool = False, replicas: bool = False
    ) -> None:
        """Compiles ahead :meth:`rerun_dropping`'s program for this state and batch shape
        (cached), as ``TrainStep.compile`` does the step's: what ``fit(step_timeout=...)``
        keeps out of a rerun's deadline."""
        self._step.check_state(state)
        self._sibling().compile(
            self._entering(state), batch, heartbeat=heartbeat, replicas=replicas
        )

    def _sibling(self) -> TrainStep:
        """The dropping step (built on first use), with this step's fault bookkeeping
        (what fired) and its heartbeats."""
        step = self._step
        if self._dropping is None:
            self._dropping = TrainStep(exclude.dropping_options(step.options))
            self._dropping._internals.heartbeats = self.heartbeats  # one record of beats
        dropping = self._dropping
        dropping._extras = step._extras
        dropping._inputs.presplit_warned = step._inputs.presplit_warned
        return dropping

    def _entering(self, state: TrainState) -> TrainState:
        """``state`` as the dropping step takes it (one ``device_put`` of its fields)."""
        step = self._step
        placed = step._backend.place_state(exclude.drop_fields(len(step.devices)))
        return exclude.into_dropping(state, placed, own=step.options.on_failure == "drop")

    @property
    def rows_per_device(self) -> int:
        """Rows per device of the batch dispatched last, as this process passed it."""
        return self._step._inputs.rows_per_device

    def failing_examples(
        self, state: TrainState, batch: Batch, chunks: Sequence[int], step_number: int
    ) -> list[int]:
        """Global batch indices of the examples of ``chunks`` that fail on their own
        (input, loss, gradient, model state or a user check) from ``state`` at step
        ``step_number``: the per-example health pass of the replay diagnosis. Runs on
        one device; ``axis_name`` is bound to a one-example axis, so a model that
        communicates (cross-device BatchNorm) sees each example alone. With several
        processes only the chunks of ``chunks`` this process holds are run (the other
        rows are not here): the caller gathers the rest from the other processes."""
        step = self._step
        step._inputs.check_batch(batch)
        local = step._local_positions()
        held = set(local)
        mine = [c for c in chunks if c in held]
        copy = step.local_copy(state, local[0])
        return self._passes.failing_examples(copy, batch, mine, step_number, local)

    def nonfinite_grad_leaves(
        self, state: TrainState, batch: Batch, position: int, step_number: int
    ) -> list[str]:
        """Names of the gradient leaves that are not finite for the rows
        ``devices[position]`` holds of ``batch``, run from ``state`` at step
        ``step_number`` as that device ran them (one pass over the whole chunk, on one
        device; ``axis_name`` is bound to a one-chunk axis): which layers a non-finite
        gradient reached. Used by :func:`jaxstep.diagnose`. With several processes only
        the process holding ``devices[position]`` can run it (ValueError elsewhere)."""
        step = self._step
        step._inputs.check_batch(batch)
        local = step._local_positions()
        if position not in local:
            raise ValueError(
                f"device {step.devices[position].id}'s rows are not in this process's "
                f"batch: ask process {step.devices[position].process_index}"
            )
        copy, device = step.local_copy(state, local[0]), step.devices[position].id
        bad = self._passes.nonfinite_grad_leaves(copy, batch, position, device, step_number, local)
        return [step.names["params"][i] for i in bad]

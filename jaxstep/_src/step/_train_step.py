"""The public face of a checked step: :class:`TrainStep`, over the
:class:`~jaxstep._src.step._runtime.Runtime` that does the work on its devices.

A step is a value: leaving devices out makes a new step
(:meth:`TrainStep.without_devices`) and leaves the old one valid on its own devices.
Only :meth:`TrainStep.exclude_devices`, kept for its callers, moves a step object onto
the new one (:func:`adopt`), and ``fit`` does the same to the step it was given once a
recovery left a device out (``step.devices`` shrinks, as documented). jaxstep's own
layers reach a step's runtime through :func:`runtime_of`; nothing else touches a step's
insides."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src.core import Batch
from jaxstep._src.core import Failure
from jaxstep._src.core import HealthTable
from jaxstep._src.core import Params
from jaxstep._src.core import PyTree
from jaxstep._src.core import StepOutput
from jaxstep._src.core import TrainState
from jaxstep._src.program import Options
from jaxstep._src.step._runtime import Runtime

#: Names the step answered to before 0.2.0: where each went (``TrainStep.__getattr__``).
MOVED: dict[str, str] = {
    "backend": "step.options.backend",
    "stacked": "step.options.backend == 'pmap'",
    "first_copy": "step.host_state(state)",
    "local_copy": "step.host_state(state)",
}


class TrainStep:
    """A compiled, checked training step. Build it with :func:`jaxstep.make_train_step`.

    Calling it (``state, out = step(state, batch)``) validates the batch (once per
    shape), places it, and dispatches one compiled call without waiting for the
    devices. Its face: :meth:`init`, calling it, :meth:`table`, :meth:`failures`,
    :meth:`clear_halt`, :meth:`without_devices` (a new step on fewer devices; the
    in-place :meth:`exclude_devices`); :meth:`check_state`,
    :meth:`host_state`, :meth:`place_state` (moving a state between steps);
    :meth:`compile` / :meth:`lower` (ahead of time, memory analysis); and what it was
    built with: :attr:`options`, :attr:`devices`, :attr:`names`.

    Args:
      options: every option, checked (what :func:`jaxstep.make_train_step` builds
        from its keywords; build steps with it).

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> step = tiny.step
      >>> state, out = step(step.init(tiny.params()), tiny.batches(1)[0])
      >>> int(state.step), step.table(out).failed
      (1, False)
      >>> len(step.devices), step.names["params"]
      (8, ["['b']", "['w']"])
    """

    def __init__(self, options: Options):
        self._runtime = Runtime(options)

    @classmethod
    def _on(cls, runtime: Runtime) -> TrainStep:
        """The step over ``runtime`` (one that :meth:`Runtime.without` built)."""
        step = cls.__new__(cls)
        step._runtime = runtime
        return step

    @property
    def options(self) -> Options:
        """Every option the step was built with (``step.options.backend``,
        ``.loss_fn``, ``.optimizer``, ...), read-only; ``devices`` as the step runs now."""
        return self._runtime.options

    @property
    def devices(self) -> list[jax.Device]:
        """The devices, in chunk order: chunk ``i`` of every batch runs on
        ``devices[i]`` (fewer after :meth:`exclude_devices`)."""
        return self._runtime.devices

    @property
    def names(self) -> dict[str, list[str]]:
        """The leaf names errors use: ``"params"``, ``"input"``, ``"checks"``,
        ``"state"`` and ``"model_state"`` (``jax.tree_util.keystr`` of each leaf)."""
        return self._runtime.names

    def __repr__(self) -> str:
        return f"TrainStep({self.options.summary()})"

    def __getattr__(self, name: str) -> Any:
        """A name the step answered to before, with a ``DeprecationWarning`` naming
        where it went (:data:`MOVED`); any other name raises ``AttributeError``."""
        if name.startswith("_") or name not in MOVED:
            raise AttributeError(f"'TrainStep' object has no attribute {name!r}")
        warnings.warn(
            f"step.{name} was removed from TrainStep's face in jaxstep 0.2.0: use "
            f"{MOVED[name]} (this name goes in 0.3.0)",
            DeprecationWarning,
            stacklevel=2,
        )
        runtime = self._runtime
        moved: dict[str, Any] = {
            "backend": runtime.options.backend,
            "stacked": runtime.stacked,
            "first_copy": runtime.read_first,
            "local_copy": runtime.read_at,
        }
        return moved[name]

    def init(
        self, params: Params, *, model_state: PyTree = None, rng: jax.Array | None = None
    ) -> TrainState:
        """Builds the first state from ``params`` and places it on the devices.

        The step owns what it returns: ``params`` (and ``model_state``) are copied, so
        the caller's arrays stay usable after training, under every layout.

        Args:
          params: a pytree of float arrays.
          model_state: the model's non-trained variables (e.g. linen's
            ``{"batch_stats": ...}``), or None. With it, ``loss_fn`` is called with
            ``model_state=`` and returns the new one in ``aux["model_state"]``.
          rng: optional PRNG key; then ``loss_fn(params, batch, rng)`` gets a key per
            step and device.

        Returns:
          A :class:`jaxstep.TrainState` on the step's devices.

        Raises:
          TypeError: a parameter leaf is not a float array, ``rng`` is not a PRNG key,
            or a model state is given to a step built without ``has_aux=True``.
          ValueError: ``params`` is empty or holds non-finite values.
        """
        return self._runtime.init(params, model_state, rng)

    def __call__(
        self, state: TrainState, batch: Batch, *, presplit: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Runs one step on ``batch``; chunk i of its leading axis runs on ``devices[i]``.

        Dispatches and returns at once: nothing here waits for the devices. A failed
        step returns the state unchanged (with ``halted`` set under ``raise``); read
        ``step.table(out)`` or use :func:`jaxstep.fit` to raise the error.

        Args:
          state: the state this step returned last (or from :meth:`init`); donated.
          batch: a pytree of arrays whose leading axis divides by the device count.
          presplit: every leaf is ``(n_devices, per_device, ...)``, as pmap code builds
            batches (``[i]`` runs on ``devices[i]``).

        Returns:
          ``(state, out)``: the new state and a :class:`jaxstep.StepOutput`.

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        return self._runtime.dispatch(state, batch, presplit=presplit)

    def table(self, out: StepOutput) -> HealthTable:
        """Reads a step's health table on the host (waits for that step).

        Args:
          out: the :class:`jaxstep.StepOutput` of a call.

        Returns:
          The decoded :class:`jaxstep.HealthTable`.
        """
        return self._runtime.table(out)

    def failures(self, table: HealthTable, rows_per_device: int | None = None) -> list[Failure]:
        """The failing devices of a step, in device order.

        Args:
          table: a step's health table (:meth:`table`).
          rows_per_device: rows each device held, to name the rows of a failing chunk.

        Returns:
          A :class:`jaxstep.Failure` per failing device (empty: the step passed).
        """
        return self._runtime.failures(table, rows_per_device)

    def clear_halt(self, state: TrainState) -> TrainState:
        """The same state with ``halted`` cleared, to resume from a failed step.

        Args:
          state: a state of this step (not donated).

        Returns:
          A copy with ``halted`` False.
        """
        return self._runtime.clear_halt(state)

    def without_devices(
        self, device_ids: Sequence[int], state: TrainState
    ) -> tuple[TrainStep, TrainState]:
        """A new step on this step's devices but ``device_ids`` (``jax.Device.id`` s),
        in the same order, and ``state`` on them, ready for every method of the new
        step. This step is unchanged: it still runs on its own devices, and ``state``
        (not donated) is still its state.

        The state is rebuilt from the copy of the first remaining device this process
        holds (one read of it; the devices that go are never read), ``halted`` cleared,
        and the per-device columns of its monitor (the loss-spike window, the drop
        policy's counts) kept for the remaining devices. Each batch of the new step
        splits over ``len(new.devices)`` devices: its leading axis must divide by the
        new count. Injected faults keep their devices (a fault on a device that goes
        never fires; a transient that fired does not fire again); an explicit
        ``max_dropped`` is lowered to the new count minus one where it must be. The
        new step's programs are compiled on first use. With several processes, every
        process calls it with the same ids. Under ``shard_state`` the state stays
        sharded: each leaf keeps its axis over the devices left, and a leaf whose axis
        no longer divides is padded with zeros to the next multiple (a warning names
        those leaves and the bytes per device); the padding reaches no loss, optimizer
        moment, checkpoint or ``host_state``. With ``replicas`` > 1 the device's whole
        group leaves instead.

        Args:
          device_ids: the ids of the devices to leave out, from ``step.devices``.
          state: a good state of this step (not donated).

        Returns:
          ``(new_step, new_state)``: the step on the remaining devices and the state
          on them.

        Raises:
          ValueError: an id is not one of the step's devices, or no device would
            remain, or (several processes) a process would keep none of its devices.
          TypeError: ``device_ids`` is not a sequence of ints.
        """
        runtime, placed = self._runtime.without(device_ids, state)
        return TrainStep._on(runtime), placed

    def exclude_devices(self, device_ids: Sequence[int], state: TrainState) -> TrainState:
        """Goes on without the devices ``device_ids`` (``jax.Device.id`` s), in place:
        this step object runs from now on the others, in the same order, and the state
        returned is ``state`` on them. It is :meth:`without_devices` with this object
        moved onto the new step (everything said there holds); prefer
        ``step, state = step.without_devices(ids, state)``, which leaves this step
        valid on its own devices.

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
        smaller, placed = self.without_devices(device_ids, state)
        adopt(self, smaller)
        return placed

    def check_state(self, state: TrainState) -> None:
        """Raises the error a step would raise for ``state`` (not a TrainState, donated
        by an earlier call, placed for the other backend or on other devices, built for
        another optimizer or other params), without running anything.

        Args:
          state: what a call of the step would take.

        Raises:
          TypeError, ValueError: what a call of the step would raise for ``state``.
        """
        self._runtime.check_state(state)

    def host_state(self, state: TrainState) -> TrainState:
        """A single-device copy of the whole ``state``: every leaf read into host memory
        and put back, whole, on this process's first device (under ``pmap`` without the
        device axis). What :meth:`place_state` (of this step or another) takes back.

        What it costs: every leaf, parameters and optimizer state, goes to the host and
        back, one synchronous read a leaf (it waits for the steps that make ``state``);
        a sharded leaf (``shard_state``) is gathered from every device (with several
        processes through ``multihost_utils.process_allgather``, a collective: every
        process calls it). The host holds the whole state for a moment, and the first
        device holds it whole beside its own share: under ``shard_state`` that is the
        copy the sharding exists to avoid (a model that fits only sharded may not fit
        it there).

        When to use it: between runs, not between steps: to move a state to another
        step, device count or layout (``other.place_state(step.host_state(state))``),
        to evaluate or export what was trained, in tests. Never in a training loop:
        each call stalls the device queue and copies everything. To read a few leaves,
        read those: ``jax.device_get(state.params)`` (the parameters alone, whole, as
        numpy; after an exclusion under ``shard_state="params"`` a leaf the layout
        holds padded shows its zeros at the end of its axis: ``jaxstep.testing.replicas``
        and this method cut them), ``int(jax.device_get(state.step))``. A failed step's
        error and its diagnosis never call it.

        It is a copy: later steps (which donate their state) leave it alone.

        Args:
          state: a state of this step.

        Returns:
          The state with one copy of every leaf, on this process's first device.
        """
        return self._runtime.host_state(state)

    def place_state(self, state: TrainState) -> TrainState:
        """Places a single-copy state (numpy arrays, or a step's :meth:`host_state`) on
        this step's devices: replicated, sharded by the step's rule, or stacked under
        ``pmap``. How a state moves between steps, device counts and backends:
        ``step.place_state(other_step.host_state(state))``.

        Args:
          state: a single-copy :class:`jaxstep.TrainState`.

        Returns:
          The state on this step's devices.

        Raises:
          TypeError: ``state`` is not a :class:`jaxstep.TrainState`.
        """
        return self._runtime.place_state(state)

    def compile(
        self,
        state: TrainState,
        batch: Batch,
        *,
        heartbeat: bool = False,
        check_replicas: bool = False,
        **moved: bool,
    ) -> jax.stages.Compiled:
        """Compiles the step ahead of time for this state and batch shape (cached), to
        keep compile time out of a timeout or to read ``memory_analysis()``.

        Args:
          state: a state of this step.
          batch: a batch of the shape to compile for.
          heartbeat: the variant ``fit(step_timeout=...)`` runs.
          check_replicas: the variant that also compares every device's copy of the
            state (it runs every ``divergence_every``-th step).
          **moved: ``replicas=``, this keyword's name until 0.2.0 (``replicas`` is the
            number of groups of :func:`jaxstep.make_train_step`): it answers with a
            ``DeprecationWarning``, and goes in 0.3.0.

        Returns:
          The ``jax.stages.Compiled`` program.

        Raises:
          TypeError: an unknown keyword.
        """
        if moved:
            unknown = sorted(set(moved) - {"replicas"})
            if unknown:
                raise TypeError(f"TrainStep.compile() got unexpected keywords {unknown}")
            warnings.warn(
                "step.compile(replicas=...) is step.compile(check_replicas=...) since jaxstep "
                "0.2.0 (replicas is make_train_step's number of groups); the old keyword "
                "goes in 0.3.0",
                DeprecationWarning,
                stacklevel=2,
            )
            check_replicas = moved["replicas"]
        return self._runtime.compile(
            state, batch, heartbeat=heartbeat, check_replicas=check_replicas
        )

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        """The step lowered for this state and batch (for HLO and memory analysis).

        Args:
          state: a state of this step.
          batch: a batch of the shape to lower for.

        Returns:
          The ``jax.stages.Lowered`` program.
        """
        return self._runtime.lower(state, batch)


def runtime_of(step: TrainStep) -> Runtime:
    """The runtime ``step`` runs on (jaxstep's layers: fit, diagnose, restore, the
    testing kit)."""
    return step._runtime


def adopt(step: TrainStep, other: TrainStep) -> None:
    """The step object ``step`` runs as ``other`` from now on (``other`` a step
    :meth:`TrainStep.without_devices` made of it): what ``exclude_devices`` does, and
    what ``fit`` does to the step it was given once a recovery left a device out."""
    step._runtime = other._runtime

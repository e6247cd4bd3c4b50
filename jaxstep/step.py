"""The checked data-parallel step: one per-device body, compiled by a backend.

Each device checks its input chunk, its loss, its gradients (before the first
collective, so a fault is pinned on the device that made it) and the updated
parameters; the rows are gathered into a replicated health table, every device
reaches the same verdict, and a failed step leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from jaxstep import health
from jaxstep import monitors
from jaxstep import validate
from jaxstep.backends import AXIS
from jaxstep.backends import BACKENDS
from jaxstep.backends import Backend
from jaxstep.errors import Failure
from jaxstep.errors import failures_from_table
from jaxstep.faults import Context
from jaxstep.faults import Fault
from jaxstep.faults import Injector
from jaxstep.health import COL
from jaxstep.health import COLUMNS
from jaxstep.health import HealthTable
from jaxstep.health import Status
from jaxstep.monitors import DEFAULT_DIVERGENCE_EVERY
from jaxstep.monitors import LossSpike
from jaxstep.state import TrainState

POLICIES = ("raise", "skip")
# Failures that skipping a step cannot cure: they halt under either policy.
ALWAYS_HALT = Status.DIVERGED | Status.HUNG


class StepOutput(NamedTuple):
    """What a step returns besides the new state.

    Attributes:
      metrics: ``{"loss": mean of the devices' losses}`` (replicated).
      health: the packed health table, ``(n_devices, len(jaxstep.health.COLUMNS))``
        int32, the same on every device; decode it with ``step.table(out)``.
      aux: the ``aux`` of ``loss_fn`` without ``"checks"``, one entry per device
        (leading axis ``n_devices``), or None.

    Under the ``pmap`` backend each of these carries one more leading device axis.
    """

    metrics: dict[str, jax.Array]
    health: jax.Array
    aux: Any


def _keystrs(tree: Any, prefix: str = "") -> list[str]:
    return [prefix + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


class TrainStep:
    """A compiled, checked training step. Build it with :func:`make_train_step`."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        backend: str,
        devices: Sequence[jax.Device],
        has_aux: bool,
        on_failure: str,
        max_consecutive_skips: int | None,
        divergence_every: int | None,
        loss_spike: LossSpike | None,
        verify_update: bool,
        faults: Sequence[Fault],
        donate: bool,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.on_failure = on_failure
        self.max_consecutive_skips = max_consecutive_skips
        self.divergence_every = divergence_every
        self.loss_spike = loss_spike
        self.verify_update = verify_update
        self.devices: list[jax.Device] = list(devices)
        self.backend = backend
        self._backend: Backend = BACKENDS[backend](self.devices)
        self._faults = Injector(faults, self.devices)
        self._donate = donate
        # Small arrays threaded through every call: fault bookkeeping only.
        self._split = {"fired": False, "chunk": True} if self._faults else {}
        self._extras = self._make_extras(np.arange(len(self.devices)))
        # Four programs, compiled on first use: with or without the heartbeat callback,
        # and with or without the replica check, which runs only every
        # divergence_every-th step so the other steps carry none of its cost.
        self._compiled = {
            (hb, rc): self._backend.compile(
                functools.partial(self._body, heartbeat=hb, replicas=rc), donate, self._split
            )
            for hb in (False, True)
            for rc in (False, True)
        }
        self._next_step = 0  # the step number of the state returned last
        self._clear_halt = self._backend.compile_state_fn(
            lambda s: dataclasses.replace(s, halted=jnp.zeros_like(s.halted))
        )
        self._aot: dict[Any, Any] = {}
        #: device position -> last step whose local part it finished (heartbeat mode).
        self.heartbeats: dict[int, int] = {}
        # Leaf names, filled at init, on the first batch and while tracing.
        self.names: dict[str, list[str]] = {"params": [], "input": [], "checks": [], "state": []}
        self._params_def: Any = None
        self._state_sig: Any = None
        self._last_state: Any = None
        self._batch_def: Any = None
        self._batch_key: Any = None

    # ---------------------------------------------------------------- host side
    def init(self, params: Any, *, rng: jax.Array | None = None) -> TrainState:
        """Builds the first state from ``params`` and places it on the devices.

        Args:
          params: a pytree of float arrays.
          rng: optional PRNG key; then ``loss_fn(params, batch, rng)`` gets a key per
            step and device.

        Raises:
          TypeError: a parameter leaf is not a float array.
        """
        validate.params(params)
        # Own copies: the step donates its state, and must not delete the caller's arrays.
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        opt_state = self.optimizer.init(params)
        n = len(self.devices)
        self._state_sig = None  # _check_state below learns the new state's names and shape
        # Distinct arrays for every leaf: a donated buffer may appear only once.
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=None if rng is None else jnp.array(rng, copy=True),
            halted=jnp.zeros((), bool),
            consecutive_skips=jnp.zeros((), jnp.int32),
            total_skips=jnp.zeros((), jnp.int32),
            monitor={"spike": self.loss_spike.init(n)} if self.loss_spike else {},
        )
        placed = self._backend.place_state(state)
        self._check_state(placed)  # records the state's shape
        return placed

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, StepOutput]:
        """Runs one step on ``batch``; chunk i of its leading axis runs on ``devices[i]``.

        Dispatches and returns at once: nothing here waits for the devices. A failed
        step returns the state unchanged (with ``halted`` set under ``raise``); read
        ``step.table(out)`` or use :func:`jaxstep.fit` to raise the error.

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        return self.dispatch(state, batch)

    def dispatch(
        self, state: TrainState, batch: Any, *, heartbeat: bool = False
    ) -> tuple[TrainState, StepOutput]:
        """Like calling the step; ``heartbeat=True`` also records, in
        ``self.heartbeats``, each device finishing its local part (a host callback
        per device and step: what ``fit(step_timeout=...)`` uses to name a hung device).
        On CPU a step with host callbacks runs synchronously."""
        self._check_state(state)
        self._check_batch(batch)
        number = self._step_number(state)
        placed = self._backend.place_batch(batch)
        replicas = self._replica_step(number)
        if heartbeat:
            fn = self.compile(state, batch, heartbeat=True, replicas=replicas)
        else:
            fn = self._compiled[(False, replicas)]
        state, out, self._extras = fn(state, placed, self._extras)
        self._last_state, self._next_step = state, number + 1
        return state, out

    def compile(
        self, state: TrainState, batch: Any, *, heartbeat: bool = False, replicas: bool = False
    ) -> Any:
        """Compiles the step ahead of time for this state and batch shape (cached), to
        keep compile time out of a timeout or to read ``memory_analysis()``.
        ``replicas=True``: the variant that runs every ``divergence_every``-th step."""
        self._check_state(state)
        self._check_batch(batch)
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
            return self._next_step
        return int(np.asarray(self.host_state(state).step))

    def _replica_step(self, number: int) -> bool:
        return self.divergence_every is not None and number % self.divergence_every == 0

    def replay(
        self, state: TrainState, batch: Any, *, rotation: int = 0
    ) -> tuple[TrainState, StepOutput]:
        """Runs the step again from ``state`` (not donated) with chunk ``(i + rotation)
        % n`` of ``batch`` on ``devices[i]``. Used by :func:`jaxstep.diagnose`."""
        n = len(self.devices)
        self._check_state(state)
        self._check_batch(batch)
        order = (np.arange(n) + rotation) % n
        size = jax.tree.leaves(batch)[0].shape[0] // n  # checked just above
        rows = (order[:, None] * size + np.arange(size)[None, :]).reshape(-1)
        moved = jax.tree.map(lambda x: np.asarray(x)[rows], batch)
        copy = jax.tree.map(jnp.copy, state)
        extras = dict(self._extras)
        if self._faults:
            extras["chunk"] = self._make_extras(order)["chunk"]
        placed = self._backend.place_batch(moved)
        fn = self._compiled[(False, self._replica_step(self._step_number(state)))]
        new_state, out, _ = fn(copy, placed, extras)
        return new_state, out

    def table(self, out: StepOutput) -> HealthTable:
        """Reads a step's health table on the host (waits for that step)."""
        return HealthTable.from_array(self._backend.host_table(out.health))

    def failures(self, table: HealthTable, rows_per_device: int | None = None) -> list[Failure]:
        """The failing devices of a step, in device order."""
        return failures_from_table(table, self.devices, self.names, rows_per_device)

    def clear_halt(self, state: TrainState) -> TrainState:
        """The same state with ``halted`` cleared, to resume from a failed step."""
        return self._clear_halt(state)

    def host_state(self, state: TrainState) -> TrainState:
        """One device's copy of the state, as on a single device (drops pmap's axis)."""
        return self._backend.unstack(state)

    def lower(self, state: TrainState, batch: Any) -> Any:
        """``jax.stages.Lowered`` of the step for this state and batch (for HLO and
        memory analysis)."""
        placed = self._backend.place_batch(batch)
        return self._compiled[(False, False)].lower(state, placed, self._extras)  # type: ignore[attr-defined]

    def _make_extras(self, chunks: np.ndarray) -> dict[str, Any]:
        if not self._faults:
            return {}
        values = {
            "fired": np.zeros(len(self._faults.faults), bool),
            "chunk": np.asarray(chunks, np.int32),
        }
        return self._backend.place_extras(values, self._split)

    def _check_state(self, state: Any) -> None:
        if state is self._last_state:
            return  # the state this step returned last: nothing to check
        if not isinstance(state, TrainState):
            raise TypeError(
                f"expected a jaxstep.TrainState, got {type(state).__name__}; build the "
                "first one with step.init(params)"
            )
        leaves, treedef = jax.tree.flatten(state)
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
        if self._state_sig is None:
            # The first state: from init, or one this step did not build (a resume
            # from a checkpoint or another step). Learn its leaf names and shape.
            self._params_def = jax.tree.structure(state.params)
            host = self.host_state(state)
            self.names["params"] = _keystrs(host.params)
            self.names["state"] = _keystrs(host.params, "params") + _keystrs(
                host.opt_state, "opt_state"
            )
            self._state_sig = (treedef, shapes)
        elif (treedef, shapes) != self._state_sig:
            want_def, want_shapes = self._state_sig
            if treedef != want_def:
                what = f"its structure differs: expected {want_def}, got {treedef}"
            else:
                i = next(
                    i for i, (a, b) in enumerate(zip(shapes, want_shapes, strict=True)) if a != b
                )
                what = f"leaf {i} has shape/dtype {shapes[i]}, expected {want_shapes[i]}"
            raise ValueError(
                f"this state does not fit this step ({self.backend} backend, "
                f"loss_spike={'on' if self.loss_spike else 'off'}): {what}; build the state "
                "with this step's init, or the step with the options of the one that made it"
            )

    def _check_batch(self, batch: Any) -> None:
        leaves, treedef = jax.tree.flatten(batch)
        # Hot path: the same structure and shapes as the last good batch need no walk.
        key = (treedef, tuple(getattr(x, "shape", None) for x in leaves))
        if key == self._batch_key:
            return
        validate.batch(batch, len(self.devices))
        if self._batch_def is None:
            self._batch_def = treedef
            self.names["input"] = _keystrs(batch)
        elif treedef != self._batch_def:
            raise ValueError(
                f"batch structure changed: the first batch was {self._batch_def}, this "
                f"one is {treedef}; every batch must have the same pytree structure"
            )
        self._batch_key = key

    def _beat(self, index: np.ndarray, step: np.ndarray, status: np.ndarray) -> np.ndarray:
        self.heartbeats[int(index)] = int(step)
        return np.asarray(status, np.int32)

    # ------------------------------------------------------------- device side
    def _loss(self, *args: Any, ctx: Context | None) -> tuple[jax.Array, Any]:
        loss, aux = validate.loss_output(self.loss_fn(*args), self.has_aux)
        if ctx is not None:
            loss = self._faults.loss(loss, ctx)
        return loss, aux

    def _body(
        self,
        state: TrainState,
        batch: Any,
        extras: dict[str, Any],
        *,
        heartbeat: bool,
        replicas: bool,
    ) -> tuple[TrainState, StepOutput, dict[str, Any]]:
        n = len(self.devices)
        index = jax.lax.axis_index(AXIS)
        ctx, token = None, jnp.zeros((), jnp.int32)
        if self._faults:
            ctx = Context(
                step=state.step,
                device_id=jnp.asarray([d.id for d in self.devices], jnp.int32)[index],
                chunk=extras["chunk"].reshape(-1)[0],
                rows=jnp.arange(jax.tree.leaves(batch)[0].shape[0]),
                fired=extras["fired"],
            )
            self._faults.check_rows(jax.tree.leaves(batch)[0].shape[0])
            token = self._faults.stall(ctx, token)
            batch = self._faults.input(batch, ctx)

        # 1. input, 2. loss and gradients, 3. local health: all before any collective.
        in_bad, in_leaf = health.first_nonfinite(jax.tree.leaves(batch))
        args: tuple[Any, ...] = (self._backend.vary(state.params), batch)
        if state.rng is not None:
            args += (jax.random.fold_in(jax.random.fold_in(state.rng, state.step), index),)
        loss_fn = functools.partial(self._loss, ctx=ctx)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(*args)
        checks, aux = validate.checks(aux)
        self.names["checks"] = list(checks)
        if ctx is not None:
            grads = self._faults.tree("grad", grads, ctx)
        squares = health.leaf_sum_of_squares(jax.tree.leaves(grads))
        grad_bad = ~jnp.isfinite(squares)
        status = (
            jnp.where(in_bad, int(Status.INPUT_NONFINITE), 0)
            | jnp.where(jnp.isfinite(loss), 0, int(Status.LOSS_NONFINITE))
            | jnp.where(jnp.any(grad_bad), int(Status.GRAD_NONFINITE), 0)
            | jnp.minimum(token, 0)  # keeps an injected stall ahead of the collective
        )
        check_failed = ~jnp.stack(list(checks.values())) if checks else None
        if check_failed is not None:
            status |= jnp.where(jnp.any(check_failed), int(Status.CHECK_FAILED), 0)
        row = {
            "input_leaf": in_leaf,
            "grad_leaf": health.first_true(grad_bad),
            "param_leaf": -1,
            "diverged_leaf": -1,
            "check": -1 if check_failed is None else health.first_true(check_failed),
            "loss": loss,
            "grad_norm": jnp.sqrt(jnp.sum(squares)),
        }
        prints = None
        if replicas:
            prints, param_leaf = self._replica_check(state)
            row["param_leaf"] = param_leaf
            status |= jnp.where(param_leaf >= 0, int(Status.PARAM_NONFINITE), 0)
        if heartbeat:
            # Tell the host this device finished its local part. The gradients take a
            # (zero) term from the callback's result, so it runs before the collective.
            shape = jax.ShapeDtypeStruct((), jnp.int32)
            beat = io_callback(self._beat, shape, index, state.step, status)
            zero = jnp.minimum(beat, 0)  # the callback returns status >= 0
            grads = jax.tree.map(lambda g: g + zero.astype(g.dtype), grads)
            status |= zero
        row["status"] = status

        # 4. the first collective: the health rows (one-hot, so the sum is a gather),
        # the fingerprints and the fault flags ride in the gradients' all-reduce.
        parts = [health.pack_row(row)]
        if prints is not None:
            parts.append(monitors.split16(prints))
        if ctx is not None:
            parts.append(self._faults.fire_flags(ctx).astype(jnp.float32))
        mine = (jnp.arange(n) == index)[:, None]
        grads, gathered = jax.lax.psum((grads, jnp.where(mine, jnp.concatenate(parts), 0)), AXIS)
        grads = jax.tree.map(lambda g: g / n, grads)
        table = health.to_table(gathered[:, : len(COLUMNS)])
        rest = gathered[:, len(COLUMNS) :]
        if prints is not None:
            table = self._divergence(table, monitors.join16(rest[:, : 2 * prints.shape[0]]))
        if ctx is not None:
            fired = jnp.any(rest[:, rest.shape[1] - len(self._faults.faults) :] > 0, axis=0)
            extras = dict(extras, fired=extras["fired"] | fired)

        # 5.-8. the verdict, the same on every device, and the update it allows.
        new_state, table = self._update(state, table, grads, ctx, mine)
        metrics = {"loss": jnp.mean(health.column(table, "loss"))}
        return new_state, StepOutput(metrics=metrics, health=table, aux=aux), extras

    def _replica_check(self, state: TrainState) -> tuple[jax.Array, jax.Array]:
        """This device's fingerprint of its own copy of params and optimizer state, and
        its first non-finite parameter leaf (or -1). In the every-k-steps program only."""
        leaves = jax.tree.leaves((state.params, state.opt_state))
        # The device's own buffers: marked varying, so nothing is treated as shared.
        leaves = self._backend.vary(leaves)
        n_params = len(jax.tree.leaves(state.params))
        return monitors.fingerprint(leaves), health.first_nonfinite(leaves[:n_params])[1]

    def _divergence(self, table: jax.Array, prints: jax.Array) -> jax.Array:
        diverged, first = monitors.minority(prints)
        status = table[:, COL["status"]] | jnp.where(diverged, int(Status.DIVERGED), 0)
        table = table.at[:, COL["status"]].set(status)
        return table.at[:, COL["diverged_leaf"]].set(first)

    def _update(
        self,
        state: TrainState,
        table: jax.Array,
        grads: Any,
        ctx: Context | None,
        mine: jax.Array,
    ) -> tuple[TrainState, jax.Array]:
        """Decides, then updates. By default everything the verdict needs is known
        before the update, so a ``lax.cond`` skips it on failure: no second pass over
        the state and no extra memory. ``verify_update=True`` also checks the new
        parameters before committing them (one more pass, and a second collective)."""

        def apply(operands: tuple[Any, Any]) -> tuple[Any, Any]:
            params, opt_state = operands
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        if self.verify_update:
            new_params, new_opt_state = apply((state.params, state.opt_state))
            checked = new_params if ctx is None else self._faults.tree("param", new_params, ctx)
            leaf = health.first_nonfinite(jax.tree.leaves(checked))[1]
            leaves = jax.lax.psum(jnp.where(mine[:, 0], leaf, 0), AXIS)  # one per device
            status = table[:, COL["status"]]
            # After a bad gradient every replica's update is bad too: that is the
            # gradient's fault, so parameters are blamed only when nothing else failed.
            bad = (leaves >= 0) & jnp.all(status == 0)
            table = table.at[:, COL["param_leaf"]].set(jnp.where(bad, leaves, -1))
            table = table.at[:, COL["status"]].set(
                status | jnp.where(bad, int(Status.PARAM_NONFINITE), 0)
            )
        table, ok, fields = self._verdict(state, table)
        if self.verify_update:
            params, opt_state = jax.tree.map(
                lambda a, b: jnp.where(ok, a, b),
                (new_params, new_opt_state),
                (state.params, state.opt_state),
            )
        else:
            params, opt_state = jax.lax.cond(
                ok, apply, lambda operands: operands, (state.params, state.opt_state)
            )
        return dataclasses.replace(state, params=params, opt_state=opt_state, **fields), table

    def _verdict(
        self, state: TrainState, table: jax.Array
    ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """(table with the verdict columns, ok to update, the new state's other fields)."""
        status = table[:, COL["status"]]
        monitor = state.monitor
        if self.loss_spike is not None:
            losses = health.column(table, "loss")
            spiked = self.loss_spike.check(state.monitor["spike"], losses) & (status == 0)
            status = status | jnp.where(spiked, int(Status.LOSS_SPIKE), 0)
        failed = jnp.any(status != 0)
        # Skipping cannot repair a diverged replica, nor parameters that are already
        # non-finite (found by the periodic check; verify_update never commits them).
        halting = ALWAYS_HALT if self.verify_update else ALWAYS_HALT | Status.PARAM_NONFINITE
        must_halt = jnp.any((status & int(halting)) != 0)
        if self.on_failure == "skip":
            limit = self.max_consecutive_skips
            halt_now = must_halt
            if limit is not None:
                halt_now |= failed & (state.consecutive_skips + 1 >= limit)
            skipped = failed & ~halt_now & ~state.halted
        else:
            halt_now = failed
            skipped = jnp.array(False)
        ok = ~failed & ~state.halted
        halted = state.halted | halt_now
        if self.loss_spike is not None:
            losses = health.column(table, "loss")
            monitor = {"spike": self.loss_spike.update(state.monitor["spike"], losses, ok)}
        consecutive = jnp.where(ok, 0, state.consecutive_skips + skipped).astype(jnp.int32)
        table = table.at[:, COL["status"]].set(status)
        for name, value in (
            ("step", state.step),
            ("halted", halted),
            ("skipped", skipped),
            ("consecutive_skips", consecutive),
        ):
            table = table.at[:, COL[name]].set(jnp.asarray(value).astype(jnp.int32))
        fields = {
            "step": state.step + (ok | skipped),
            "halted": halted,
            "consecutive_skips": consecutive,
            "total_skips": state.total_skips + skipped,
            "monitor": monitor,
        }
        return table, ok, fields


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    backend: str = "shard_map",
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    on_failure: str = "raise",
    max_consecutive_skips: int | None = 10,
    divergence_every: int | None = DEFAULT_DIVERGENCE_EVERY,
    loss_spike: LossSpike | None = None,
    verify_update: bool = False,
    faults: Sequence[Fault] = (),
    donate: bool = True,
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
        training goes on, until ``max_consecutive_skips`` failures in a row halt it.
        A diverged replica halts under either policy.
      max_consecutive_skips: with ``"skip"``, the N-th failed step in a row halts the
        run (after N-1 skips) and :func:`fit` raises (None: never).
      divergence_every: every this many steps each device fingerprints its copy of
        the parameters and optimizer state; a device that disagrees with the majority
        fails with ``DIVERGED`` (None: never).
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
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got "
            f"{type(optimizer).__name__}; e.g. optax.adam(1e-3)"
        )
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'shard_map' or 'pmap'")
    if on_failure not in POLICIES:
        raise ValueError(f"unknown on_failure policy {on_failure!r}; expected 'raise' or 'skip'")
    validate.positive_or_none("max_consecutive_skips", max_consecutive_skips)
    validate.positive_or_none("divergence_every", divergence_every)
    if loss_spike is not None and not isinstance(loss_spike, LossSpike):
        raise TypeError(f"loss_spike must be a jaxstep.LossSpike or None, got {loss_spike!r}")
    for f in faults:
        if not isinstance(f, Fault):
            raise TypeError(f"faults must hold jaxstep.testing.Fault objects, got {f!r}")
        if f.kind == "param" and not verify_update:
            raise ValueError(
                f"{f!r} corrupts the checked new parameters, which only verify_update=True "
                "checks: build the step with verify_update=True"
            )
    return TrainStep(
        loss_fn,
        optimizer,
        backend=backend,
        devices=validate.devices(devices),
        has_aux=has_aux,
        on_failure=on_failure,
        max_consecutive_skips=max_consecutive_skips,
        divergence_every=divergence_every,
        loss_spike=loss_spike,
        verify_update=verify_update,
        faults=faults,
        donate=donate,
    )

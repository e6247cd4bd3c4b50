"""The checked data-parallel step: one per-device body, compiled by a backend.

Each device checks its input chunk, its loss, its gradients (before the first
collective, so a fault is pinned on the device that made it) and the updated
parameters; the rows are gathered into a replicated health table, every device
reaches the same verdict, and a failed step leaves the state unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstep import health
from jaxstep.backends import AXIS
from jaxstep.backends import BACKENDS
from jaxstep.backends import Backend
from jaxstep.errors import Failure
from jaxstep.errors import failures_from_table
from jaxstep.health import COL
from jaxstep.health import HealthTable
from jaxstep.health import Status
from jaxstep.state import TrainState

POLICIES = ("raise", "skip")


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


def _keystrs(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


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
        donate: bool,
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.on_failure = on_failure
        self.max_consecutive_skips = max_consecutive_skips
        self.devices: list[jax.Device] = list(devices)
        self._backend: Backend = BACKENDS[backend](self.devices)
        self.backend = backend
        self._compiled = self._backend.compile(self._body, donate)
        self._clear_halt = self._backend.compile_state_fn(
            lambda s: dataclasses.replace(s, halted=jnp.zeros_like(s.halted))
        )
        # Leaf names, filled at init, on the first batch and while tracing.
        self.names: dict[str, list[str]] = {"params": [], "input": [], "checks": [], "state": []}
        self._params_def: Any = None
        self._batch_def: Any = None

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
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            name = jax.tree_util.keystr(path)
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, float)):
                raise TypeError(
                    f"parameter {name} is a {type(leaf).__name__}, not an array; params "
                    "must be a pytree of float arrays: keep configuration and modules out "
                    "of it (close over them in loss_fn)"
                )
            if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
                raise TypeError(
                    f"parameter {name} has dtype {jnp.asarray(leaf).dtype}; only float "
                    "parameters can be trained: cast it (jnp.asarray(x, jnp.float32)) or "
                    "keep integer constants out of params"
                )
        # Own copies: the step donates its state, and must not delete the caller's arrays.
        params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        self._params_def = jax.tree.structure(params)
        self.names["params"] = _keystrs(params)
        opt_state = self.optimizer.init(params)
        # Distinct arrays for every leaf: a donated buffer may appear only once.
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=opt_state,
            rng=None if rng is None else jnp.array(rng, copy=True),
            halted=jnp.zeros((), bool),
            consecutive_skips=jnp.zeros((), jnp.int32),
            total_skips=jnp.zeros((), jnp.int32),
        )
        self.names["state"] = _keystrs(state)
        return self._backend.place_state(state)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, StepOutput]:
        """Runs one step on ``batch``; chunk i of its leading axis runs on ``devices[i]``.

        Dispatches and returns at once: nothing here waits for the devices. A failed
        step returns the state unchanged (with ``halted`` set under ``raise``); read
        ``step.table(out)`` or use :func:`jaxstep.fit` to raise the error.

        Raises:
          ValueError, TypeError: the batch or state is malformed; nothing ran and the
            state is still usable.
        """
        self._check_state(state)
        self._check_batch(batch)
        return self._compiled(state, self._backend.place_batch(batch))

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

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"expected a jaxstep.TrainState, got {type(state).__name__}; build the "
                "first one with step.init(params)"
            )
        if self._params_def is not None and jax.tree.structure(state.params) != self._params_def:
            raise ValueError(
                "state.params does not have the structure given to step.init: "
                f"expected {self._params_def}, got {jax.tree.structure(state.params)}"
            )

    def _check_batch(self, batch: Any) -> None:
        n = len(self.devices)
        leaves = jax.tree_util.tree_leaves_with_path(batch)
        if not leaves:
            raise ValueError("the batch has no arrays; pass a pytree of arrays")
        sizes = {}
        for path, leaf in leaves:
            name = jax.tree_util.keystr(path) or "batch"
            shape = getattr(leaf, "shape", None)
            if shape is None:
                raise TypeError(
                    f"batch leaf {name} is a {type(leaf).__name__}, not an array; "
                    "convert it with np.asarray"
                )
            if len(shape) == 0:
                raise ValueError(
                    f"batch leaf {name} is a scalar; every batch leaf needs a leading "
                    "example axis that is split across the devices"
                )
            sizes[name] = shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"batch leaves disagree on the leading (example) axis: {sizes}; every "
                "leaf needs the same number of examples"
            )
        size = next(iter(sizes.values()))
        if size % n:
            lo, hi = size // n * n, (size // n + 1) * n
            raise ValueError(
                f"batch leading axis {size} does not divide by the {n} devices; use a "
                f"multiple of {n} (e.g. {lo or n} or {hi}) or drop the last partial batch"
            )
        treedef = jax.tree.structure(batch)
        if self._batch_def is None:
            self._batch_def = treedef
            self.names["input"] = [jax.tree_util.keystr(p) for p, _ in leaves]
        elif treedef != self._batch_def:
            raise ValueError(
                f"batch structure changed: the first batch was {self._batch_def}, this "
                f"one is {treedef}; every batch must have the same pytree structure"
            )

    # ------------------------------------------------------------- device side
    def _loss(self, *args: Any) -> tuple[jax.Array, Any]:
        out = self.loss_fn(*args)
        if self.has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"has_aux=True but loss_fn returned {type(out).__name__}; return "
                    "(loss, aux) or build the step with has_aux=False"
                )
            loss, aux = out
        else:
            if isinstance(out, (tuple, list)):
                raise TypeError(
                    f"loss_fn returned a {type(out).__name__} of {len(out)}; return a "
                    "scalar loss, or (loss, aux) with has_aux=True"
                )
            loss, aux = out, None
        shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
        if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"loss_fn must return a float scalar loss, got shape {shape} and dtype "
                f"{dtype}; reduce it over the examples (e.g. jnp.mean(per_example)) and "
                "keep it floating point"
            )
        return loss, aux

    def _split_checks(self, aux: Any) -> tuple[jax.Array, jax.Array, Any]:
        """(any user check failed, index of the first failing one or -1, aux without checks)."""
        if not (isinstance(aux, dict) and "checks" in aux):
            return jnp.array(False), jnp.array(-1, jnp.int32), aux
        checks = aux["checks"]
        rest = {k: v for k, v in aux.items() if k != "checks"} or None
        if not isinstance(checks, dict):
            raise TypeError(
                f"aux['checks'] must be a dict of named boolean scalars, got "
                f"{type(checks).__name__}"
            )
        names = sorted(checks)
        for name in names:
            v = checks[name]
            if getattr(v, "shape", None) != () or getattr(v, "dtype", None) != jnp.bool_:
                raise TypeError(
                    f"aux['checks'][{name!r}] must be a boolean scalar, got shape "
                    f"{getattr(v, 'shape', None)} and dtype {getattr(v, 'dtype', None)}; "
                    "reduce it (e.g. jnp.all(x < 10.0))"
                )
        self.names["checks"] = names
        failed = jnp.logical_not(jnp.stack([checks[k] for k in names]))
        first = jnp.where(jnp.any(failed), jnp.argmax(failed), -1).astype(jnp.int32)
        return jnp.any(failed), first, rest

    def _body(self, state: TrainState, batch: Any) -> tuple[TrainState, StepOutput]:
        n = len(self.devices)
        index = jax.lax.axis_index(AXIS)
        in_bad, in_leaf = health.first_nonfinite(jax.tree.leaves(batch))

        args: tuple[Any, ...] = (self._backend.vary(state.params), batch)
        if state.rng is not None:
            args += (jax.random.fold_in(jax.random.fold_in(state.rng, state.step), index),)
        (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(*args)
        check_bad, check_idx, aux = self._split_checks(aux)

        grad_leaves = jax.tree.leaves(grads)
        grad_bad, grad_leaf = health.first_nonfinite(grad_leaves)
        status = (
            jnp.where(in_bad, int(Status.INPUT_NONFINITE), 0)
            | jnp.where(jnp.isfinite(loss), 0, int(Status.LOSS_NONFINITE))
            | jnp.where(grad_bad, int(Status.GRAD_NONFINITE), 0)
            | jnp.where(check_bad, int(Status.CHECK_FAILED), 0)
        )

        # The first collective: everything above was measured on this device alone.
        grads = jax.lax.pmean(grads, AXIS)
        updates, new_opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        _, param_leaf = health.first_nonfinite(jax.tree.leaves(new_params))

        row = health.pack_row(
            {
                "status": status,
                "input_leaf": in_leaf,
                "grad_leaf": grad_leaf,
                "param_leaf": param_leaf,
                "check": check_idx,
                "loss": loss,
                "grad_norm": jnp.sqrt(health.sum_of_squares(grad_leaves)),
            }
        )
        # Gather as a psum of one-hot rows: the result is replicated (device-invariant).
        table = jax.lax.psum(jnp.where((jnp.arange(n) == index)[:, None], row[None, :], 0), AXIS)
        new_state, table = self._verdict(state, table, new_params, new_opt_state)
        metrics = {"loss": jnp.mean(health.column(table, "loss"))}
        return new_state, StepOutput(metrics=metrics, health=table, aux=aux)

    def _verdict(
        self, state: TrainState, table: jax.Array, new_params: Any, new_opt_state: Any
    ) -> tuple[TrainState, jax.Array]:
        status = table[:, COL["status"]]
        # A non-finite update after a bad gradient is that gradient's fault, and it is
        # the same on every device: blame parameters only when nothing failed before.
        params_bad = (table[:, COL["param_leaf"]] >= 0) & jnp.all(status == 0)
        status = status | jnp.where(params_bad, int(Status.PARAM_NONFINITE), 0)
        failed = jnp.any(status != 0)

        if self.on_failure == "skip":
            limit = self.max_consecutive_skips
            if limit is None:
                halt_now = jnp.array(False)
            else:
                halt_now = failed & (state.consecutive_skips + 1 >= limit)
            skipped = failed & ~halt_now & ~state.halted
        else:
            halt_now = failed
            skipped = jnp.array(False)
        ok = ~failed & ~state.halted
        halted = state.halted | halt_now

        def pick(new: Any, old: Any) -> Any:
            # Fuses into the update itself: no copy of params or optimizer state.
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

        consecutive = jnp.where(ok, 0, state.consecutive_skips + skipped)
        new_state = dataclasses.replace(
            state,
            step=state.step + (ok | skipped),
            params=pick(new_params, state.params),
            opt_state=pick(new_opt_state, state.opt_state),
            halted=halted,
            consecutive_skips=consecutive.astype(jnp.int32),
            total_skips=state.total_skips + skipped,
        )
        table = table.at[:, COL["status"]].set(status)
        for name, value in (
            ("step", state.step),
            ("halted", halted),
            ("skipped", skipped),
            ("consecutive_skips", consecutive),
        ):
            table = table.at[:, COL[name]].set(jnp.asarray(value).astype(jnp.int32))
        return new_state, table


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    backend: str = "shard_map",
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    on_failure: str = "raise",
    max_consecutive_skips: int | None = 10,
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
      max_consecutive_skips: with ``"skip"``, the run halts after this many failed
        steps in a row (None: never).
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
    if max_consecutive_skips is not None and (
        not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips must be a positive int or None, got {max_consecutive_skips!r}"
        )
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; pass at least one jax.Device, or None for all")
    for d in devices:
        if not isinstance(d, jax.Device):
            raise TypeError(
                f"devices must hold jax.Device objects, got {d!r}; e.g. jax.devices()[:4]"
            )
    platforms = sorted({d.platform for d in devices})
    if len(platforms) > 1:
        raise ValueError(
            f"devices mix platforms {platforms}; one step runs on one platform: pass e.g. "
            f"jax.devices({platforms[0]!r})"
        )
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices lists a device twice: ids {ids}")
    return TrainStep(
        loss_fn,
        optimizer,
        backend=backend,
        devices=devices,
        has_aux=has_aux,
        on_failure=on_failure,
        max_consecutive_skips=max_consecutive_skips,
        donate=donate,
    )

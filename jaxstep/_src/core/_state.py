"""What a step reads and returns: the training state (a pytree of arrays and nothing
else, so it checkpoints, pickles and transfers as plain data; functions, the loss,
optimizer and mesh, live in the step object) and the step's output."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxstep._src.core._types import Params
from jaxstep._src.core._types import PyTree


class LossScaleState(NamedTuple):
    """The scale in the training state: ``scale`` (float32) and the good steps in a
    row since it last changed (``good_steps``, int32: flax's ``fin_steps``). What
    :class:`jaxstep.DynamicLossScale` (the program layer) keeps between steps."""

    scale: jax.Array
    good_steps: jax.Array


@struct.dataclass
class TrainState:
    """Everything a step reads and writes.

    Attributes:
      step: steps taken (skipped steps count: they consumed a batch).
      params: the model parameters.
      opt_state: the optimizer state.
      rng: a PRNG key, or None. When set, ``loss_fn(params, batch, rng)`` gets a key
        folded with the step and the chunk of the batch the device holds (its
        position), so every device draws its own numbers and a replay draws the same
        ones, for the same rows, on whichever device it moves them to.
      halted: True once a step failed under the ``raise`` policy (or too many skips
        in a row): every later step leaves the state unchanged.
      consecutive_skips: skipped steps in a row (``skip`` policy).
      total_skips: skipped steps in all.
      monitor: memory of the cross-step checks (the loss-spike window), a dict.
      model_state: the model's non-trained variables (BatchNorm statistics,
        counters), or None: ``loss_fn(..., model_state=ms)`` returns the new one as
        ``aux["model_state"]``; float leaves are averaged over the devices each step.
      loss_scale: with a :class:`jaxstep.DynamicLossScale`, its state: ``.scale``
        (float32) and ``.good_steps`` (int32, the good steps in a row since the scale
        last changed; flax's ``fin_steps``); else None.
      total_drops: with ``on_failure="drop"``, the device-steps left out of a step's
        mean so far (None under the other policies: their program does not carry it).
        The per-device memory of that policy (steps in a row each device was left out,
        replicas repaired) is in ``monitor["drops"]`` and ``monitor["repairs"]``.

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> state = tiny.step.init(tiny.params())  # {"w": zeros (3, 1), "b": zeros (1,)}
      >>> int(state.step), bool(state.halted), state.params["w"].shape, state.rng
      (0, False, (3, 1), None)
    """

    step: jax.Array
    params: Params
    opt_state: PyTree
    rng: jax.Array | None
    halted: jax.Array
    consecutive_skips: jax.Array
    total_skips: jax.Array
    monitor: dict[str, Any]
    model_state: PyTree = None
    loss_scale: LossScaleState | None = None
    total_drops: jax.Array | None = None

    def __repr__(self) -> str:
        """A summary (a CNN's full repr runs to tens of thousands of characters): the
        step, each part's leaves and bytes, the flags. ``jax.tree.map(print, state)``
        shows every array."""
        leaves = jax.tree.leaves(self)
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            return "TrainState(<donated: its arrays were deleted; use the state returned>)"
        parts = [f"step={_scalar(self.step)}"]
        copies = int(np.shape(self.step)[0]) if np.ndim(self.step) else 1  # pmap: stacked
        for name in ("params", "opt_state", "model_state"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={_size(value, copies)}")
        parts.append(f"rng={'None' if self.rng is None else 'key'}")
        parts.append(f"halted={bool(_scalar(self.halted))}")
        parts.append(
            f"skips={_scalar(self.total_skips)} ({_scalar(self.consecutive_skips)} in a row)"
        )
        if self.total_drops is not None:
            parts.append(f"drops={_scalar(self.total_drops)}")
        if self.loss_scale is not None:
            parts.append(f"loss_scale={_scalar(self.loss_scale.scale)}")
        where = _where(self.step)
        return f"TrainState({', '.join(parts)}{where})"


def _scalar(x: Any) -> Any:
    """The value of a (replicated, or pmap-stacked) scalar leaf."""
    value = np.asarray(x).reshape(-1)[0] if np.size(x) else None
    return value.item() if isinstance(value, np.generic) else value


def _size(tree: Any, copies: int) -> str:
    """Leaves, bytes of one copy, dtypes."""
    leaves = jax.tree.leaves(tree)
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves) // copies
    dtypes = sorted({str(getattr(x, "dtype", type(x).__name__)) for x in leaves})
    count = f"{len(leaves)} leaf" if len(leaves) == 1 else f"{len(leaves)} leaves"
    return f"<{count}, {_bytes(nbytes)}, {'/'.join(dtypes) or '-'}>"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _where(x: Any) -> str:
    if not isinstance(x, jax.Array):
        return ", on the host"
    devices = len(x.sharding.device_set)
    how = "stacked (pmap)" if x.ndim else "replicated"
    return f", on {devices} device{'s' if devices != 1 else ''}, {how}"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StepInfo:
    """Static facts of a compiled step, returned with every output (no arrays: a
    leafless pytree node, so it costs nothing per call): what the host learns from
    tracing, without the trace writing to host state.

    Attributes:
      checks: the names of the user checks in ``aux["checks"]``, in table order.
    """

    checks: tuple[str, ...] = ()


class StepOutput(NamedTuple):
    """What a step returns besides the new state.

    Attributes:
      metrics: ``{"loss": mean of the devices' losses}`` (replicated).
      health: the packed health table, an ``(n_devices, columns)`` int32 array, the
        same on every device; ``step.table(out)`` reads and decodes it
        (:class:`jaxstep.HealthTable`).
      aux: the ``aux`` of ``loss_fn`` without ``"checks"``, one entry per device
        (leading axis ``n_devices``), or None.
      info: static facts of the compiled step, no arrays: ``info.checks``, the names
        of the checks ``loss_fn`` returned in ``aux["checks"]``, in table order.

    Under the ``pmap`` backend each array carries one more leading device axis.

    Example:
      >>> import jaxstep
      >>> tiny = jaxstep.testing.tiny_step(divergence_every=None)
      >>> state, out = tiny.step(tiny.state(), tiny.batches(1)[0])
      >>> round(float(out.metrics["loss"]), 3), out.health.shape[0], out.aux
      (3.264, 8, None)
    """

    metrics: dict[str, jax.Array]
    health: jax.Array
    aux: PyTree
    info: StepInfo = StepInfo()


@dataclasses.dataclass(frozen=True)
class HostKey:
    """A typed PRNG key on the host: its raw data and implementation name."""

    data: np.ndarray
    impl: str


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(fn: Callable[[Any], Any], tree: PyTree) -> PyTree:
    """``fn`` over every leaf as numpy; typed PRNG keys (which numpy cannot hold) go
    through their raw key data and come back as :class:`HostKey`."""

    def one(x: Any) -> Any:
        if _is_key(x):
            return HostKey(fn(jax.random.key_data(x)), str(jax.random.key_impl(x)))
        return fn(x)

    return jax.tree.map(one, tree)


def from_host(tree: PyTree) -> PyTree:
    """Undoes the :class:`HostKey` wrapping of :func:`to_host`."""
    return jax.tree.map(
        lambda x: (
            jax.random.wrap_key_data(jnp.asarray(x.data), impl=x.impl)
            if isinstance(x, HostKey)
            else x
        ),
        tree,
        is_leaf=lambda x: isinstance(x, HostKey),
    )

"""Faults compiled into a step, for tests, notebooks and the demo.

A :class:`Fault` puts NaN or Inf into one device's input, loss, one gradient leaf or
one parameter leaf at one step, multiplies its loss by a finite factor (a loss spike,
for :class:`~jaxstep.LossSpike`), or stalls that device. It is compiled into the step
(no host round trip; a step built without faults carries none of this code):

- ``mode="device"``: the device fails whatever data it gets (a bad chip);
- ``mode="transient"``: only the first execution of that step fails (a one-off);
- ``mode="data"``: the fault travels with the batch chunk the device had, and with
  example ``example`` of it (a bad record); a replay that moves the chunk to another
  device moves the fault too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple
from typing import cast
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxstep._src.core import Batch
from jaxstep._src.core import FaultKind
from jaxstep._src.core import FaultMode
from jaxstep._src.core import PyTree
from jaxstep._src.core.names import leaf_name
from jaxstep._src.core.names import without_root
from jaxstep._src.program._chips import each_chip

KINDS: tuple[FaultKind, ...] = get_args(FaultKind)
MODES: tuple[FaultMode, ...] = get_args(FaultMode)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault.

    Attributes:
      kind: ``"input"``, ``"loss"``, ``"grad"``, ``"param"`` or ``"stall"``.
      device_id: the ``jax.Device.id`` that fails (for ``mode="data"``: the device
        whose chunk carries the fault in the normal placement).
      step: the ``state.step`` at which it fires.
      mode: ``"device"``, ``"transient"`` or ``"data"`` (see the module docstring).
      value: what is written: ``float("nan")`` (default) or ``float("inf")``; for
        ``loss``, a finite number is a factor instead: the loss (and so its gradient)
        times ``value``, a loss spike that :class:`~jaxstep.LossSpike` catches.
      leaf: for ``grad``/``param``: the ``jax.tree_util.keystr`` of the leaf (default
        the first), ``"['w']"`` or ``"params['w']"``; for ``input``: the batch leaf
        (default the first float one).
      example: the row of the device's chunk that carries an ``input`` fault, and the
        example a ``data`` fault belongs to.
      seconds: how long a ``stall`` blocks the device.

    Example:
      A NaN written into device 3's gradient of ``['w']`` at step 1:

      >>> import jaxstep
      >>> from jaxstep.testing import Fault, tiny_step
      >>> tiny = tiny_step(faults=[Fault("grad", device_id=3, step=1, leaf="['w']")])
      >>> try:
      ...     jaxstep.fit(tiny.step, tiny.state(), tiny.batches(3), diagnose=False)
      ... except jaxstep.TrainingWorkerError as err:
      ...     print(err.device_id, err.step, err.status.name, err.leaf)
      3 1 GRAD_NONFINITE ['w']
    """

    kind: FaultKind
    device_id: int
    step: int
    mode: FaultMode = "device"
    value: float = math.nan
    leaf: str | None = None
    example: int = 0
    seconds: float = 120.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {KINDS}")
        if self.mode not in MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}; expected one of {MODES}")
        if math.isfinite(self.value) and self.kind != "loss":
            raise ValueError(
                f"a {self.kind!r} fault writes NaN or Inf, got value={self.value!r} (only "
                "a 'loss' fault takes a finite value: the factor of a loss spike)"
            )
        if self.step < 0 or self.example < 0:
            raise ValueError(f"step and example must be >= 0, got {self.step}, {self.example}")
        if self.kind in ("grad", "param"):  # "params['w']", as step.names writes it
            object.__setattr__(self, "leaf", without_root(self.leaf, "params"))


class Context(NamedTuple):
    """Where a piece of the step runs: traced values inside the step."""

    step: jax.Array  # state.step
    device_id: jax.Array  # jax.Device.id of this device
    chunk: jax.Array  # which chunk of the global batch this device holds
    rows: jax.Array  # the rows of that chunk present here (all of them, or one)
    fired: jax.Array  # (len(faults),) bool: transient faults that fired already


class Injector:
    """The faults of one step, resolved against its devices."""

    def __init__(
        self,
        faults: Sequence[Fault],
        devices: Sequence[jax.Device],
        groups: Sequence[Sequence[jax.Device]] | None = None,
    ):
        """``devices``: the step's units (each model group's first device, under
        ``model_parallel``); ``groups``: every device of each (None: one each). A fault
        on any device of a group fires in that group."""
        self.faults = tuple(faults)
        groups = [[d] for d in devices] if groups is None else groups
        #: each device id -> the position of the unit holding it
        self._position = {d.id: i for i, g in enumerate(groups) for d in g}
        ids = [d.id for g in groups for d in g]
        for f in self.faults:
            if f.device_id not in self._position:
                raise ValueError(
                    f"fault on device {f.device_id}, which is not among the step's devices {ids}"
                )
        self._unit = {d: devices[i].id for d, i in self._position.items()}
        self.model_parallel = len(groups[0]) if groups else 1

    def __bool__(self) -> bool:
        return bool(self.faults)

    def validate(self, names: Mapping[str, Sequence[str]]) -> None:
        """Raises now, before anything runs, for a fault on a leaf that does not exist.

        Called with what the step has learned so far: ``{"grad": ..., "param": ...}``
        (the parameter leaves) at ``step.init``, ``{"input": ...}`` (the batch's float
        leaves, see :func:`float_leaves`) at the first batch. Kinds not in ``names``
        are not checked.

        Raises:
          ValueError: naming the fault and listing the leaves it may name.
        """
        for f in self.faults:
            if f.kind == "input" and f.leaf is None and "input" in names and not names["input"]:
                raise ValueError(
                    f"{f!r} writes {f.value} into a float leaf of the batch, and this batch "
                    "has none (token ids?): a bad record in a token model shows as a "
                    "non-finite loss, Fault('loss', device_id, step, mode='data', "
                    "example=...)"
                )
            if f.leaf is None or f.kind not in names:
                continue
            known = list(names[f.kind])
            if f.leaf not in known:
                what = "batch's float leaves" if f.kind == "input" else "parameter leaves"
                raise ValueError(
                    f"{f!r} names leaf {f.leaf!r}, which does not exist; the {what} are "
                    f"{known} (names as jax.tree_util.keystr writes them)"
                )

    def check_rows(self, rows: int) -> None:
        """Raises (at trace time) for a fault on an example the chunks do not have."""
        for f in self.faults:
            if (f.mode == "data" or f.kind == "input") and f.example >= rows:
                raise ValueError(
                    f"{f!r} is on example {f.example}, but each device's chunk has {rows} "
                    f"rows: pick example in 0..{rows - 1}"
                )

    def _active(self, k: int, ctx: Context) -> jax.Array:
        f = self.faults[k]
        on = ctx.step == f.step
        if f.mode == "data":
            on &= (ctx.chunk == self._position[f.device_id]) & jnp.any(ctx.rows == f.example)
        else:
            on &= ctx.device_id == self._unit[f.device_id]
        if f.mode == "transient":
            on &= ~ctx.fired[k]
        return on

    def _each(self, kind: str) -> list[tuple[int, Fault]]:
        return [(k, f) for k, f in enumerate(self.faults) if f.kind == kind]

    def fire_flags(self, ctx: Context) -> jax.Array:
        """(len(faults),) bool: which faults fire on this device in this step."""
        if not self.faults:
            return jnp.zeros((0,), bool)
        return jnp.stack([self._active(k, ctx) for k in range(len(self.faults))])

    def stall(self, ctx: Context, token: jax.Array) -> jax.Array:
        """Blocks this device for ``seconds`` where a stall fault fires."""
        for k, f in self._each("stall"):

            def sleep(chip: jax.Array, on: jax.Array, token: jax.Array, f: Fault = f) -> jax.Array:
                # every device of a model group sleeps: the fault is the group's
                shape = jax.ShapeDtypeStruct((), jnp.int32)
                return io_callback(_sleep_if, shape, on, f.seconds, token)

            token = each_chip(self.model_parallel, sleep, self._active(k, ctx), token)
        return token

    def input(self, batch: Batch, ctx: Context) -> Batch:
        for k, f in self._each("input"):
            paths = jax.tree_util.tree_leaves_with_path(batch)
            names = [leaf_name(p) for p, _ in paths]
            floats = [n for n, (_, x) in zip(names, paths, strict=True) if _is_float(x)]
            target = f.leaf or (floats[0] if floats else None)
            if target not in floats:
                raise ValueError(
                    f"input fault on leaf {f.leaf!r}: the batch's float leaves are {floats}"
                )
            row_hit = ctx.rows == f.example
            on = self._active(k, ctx)

            def poison(
                path: Any, x: jax.Array, on: Any = on & row_hit, target: str = target, f: Fault = f
            ) -> Any:
                if leaf_name(path) != target:
                    return x
                mask = on.reshape((-1,) + (1,) * (x.ndim - 1))
                return jnp.where(mask, jnp.asarray(f.value, x.dtype), x)

            batch = jax.tree_util.tree_map_with_path(poison, batch)
        return batch

    def loss_factor(self, ctx: Context) -> jax.Array | None:
        """What the loss faults multiply this device's loss (and so its gradients) by
        now: a float32 scalar, 1 where none fires (NaN, Inf, or a spike's factor where
        one does); None when the step has no loss fault."""
        factor = None
        for k, f in self._each("loss"):
            fired = jnp.where(self._active(k, ctx), jnp.float32(f.value), jnp.float32(1))
            factor = fired if factor is None else factor * fired
        return factor

    def after_loss(self, value: jax.Array, grads: PyTree, ctx: Context) -> tuple[jax.Array, PyTree]:
        """The loss and its gradients as a loss fault leaves them: times its factor
        where it fires (d(c * loss) = c * d(loss)). Applied to what the differentiation
        returned, with a select, never inside it: the arithmetic of the step itself is
        the step's without faults, bit for bit, until a fault fires."""
        factor = self.loss_factor(ctx)
        if factor is None:
            return value, grads
        return spiked(value, factor), jax.tree.map(lambda g: spiked(g, factor), grads)

    def tree(self, kind: str, tree: PyTree, ctx: Context) -> PyTree:
        """Writes the fault value into one leaf of ``tree`` (gradients or parameters)."""
        for k, f in self._each(kind):
            names = [leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
            target = f.leaf or names[0]
            if target not in names:
                raise ValueError(f"{kind} fault on leaf {f.leaf!r}: the leaves are {names}")
            on = self._active(k, ctx)

            def poison(
                path: Any, x: jax.Array, on: Any = on, target: str = target, f: Fault = f
            ) -> Any:
                if leaf_name(path) != target:
                    return x
                return jnp.where(on, jnp.asarray(f.value, x.dtype), x)

            tree = jax.tree_util.tree_map_with_path(poison, tree)
        return tree

    def leaf_value(self, kind: str, names: Sequence[str], i: int, ctx: Context) -> jax.Array | None:
        """What the faults of ``kind`` write into leaf ``names[i]`` (of a tree whose
        leaves are ``names``) on this device now: a float32 scalar, 0 where none fires,
        or None when no fault names that leaf (``shard_state="params"`` injects a
        gradient fault into one leaf's own cotangent, where :meth:`tree` cannot
        reach)."""
        value = None
        for k, f in self._each(kind):
            target = f.leaf or names[0]
            if target not in names:
                raise ValueError(f"{kind} fault on leaf {f.leaf!r}: the leaves are {list(names)}")
            if target != names[i]:
                continue
            fired = jnp.where(self._active(k, ctx), jnp.float32(f.value), jnp.float32(0))
            value = fired if value is None else jnp.where(fired != 0, fired, value)
        return value


class Armed:
    """The one seam between the injected faults and the traced step: a device's faults
    at one step (:meth:`jaxstep._src.program.Options.arm`), called by the step at its named
    points (the input, the loss, the gradients, the new parameters, a stall, the fire
    flags). :data:`NO_FAULTS` is the same seam for a step built without faults: every
    point hands its value through, so that step's program holds none of this."""

    def __init__(self, injector: Injector, ctx: Context | None):
        self._injector, self._ctx = injector, ctx

    def __bool__(self) -> bool:
        return bool(self._injector)

    @property
    def _at(self) -> Context:
        # None only in NO_FAULTS, whose injector has no fault to read it
        return cast(Context, self._ctx)

    @property
    def count(self) -> int:
        """The step's faults (one fire flag each)."""
        return len(self._injector.faults)

    def rows(self, start: jax.Array, size: int) -> Armed:
        """These faults for the ``size`` rows from ``start`` of the chunk (a micro-batch)."""
        if self._ctx is None:
            return self
        return Armed(self._injector, self._ctx._replace(rows=start + jnp.arange(size)))

    def check_rows(self, rows: int) -> None:
        """Raises (at trace time) for a fault on an example the chunks do not have."""
        self._injector.check_rows(rows)

    def stall(self, token: jax.Array) -> jax.Array:
        """Blocks this device where a stall fires (``token``: its mark)."""
        return self._injector.stall(self._at, token)

    def input(self, batch: Batch) -> Batch:
        """The batch as an input fault leaves it."""
        return self._injector.input(batch, self._at)

    def after_loss(self, value: jax.Array, grads: PyTree) -> tuple[jax.Array, PyTree]:
        """The loss and its gradients as a loss fault leaves them."""
        return self._injector.after_loss(value, grads, self._at)

    def grads(self, grads: PyTree) -> PyTree:
        """The gradients as a gradient fault leaves them."""
        return self._injector.tree("grad", grads, self._at)

    def params(self, params: PyTree) -> PyTree:
        """The (checked) new parameters as a parameter fault leaves them."""
        return self._injector.tree("param", params, self._at)

    def loss_factor(self) -> jax.Array | None:
        """:meth:`Injector.loss_factor` now."""
        return self._injector.loss_factor(self._at)

    def leaf_value(self, kind: str, names: Sequence[str], i: int) -> jax.Array | None:
        """:meth:`Injector.leaf_value` now."""
        return self._injector.leaf_value(kind, names, i, self._at)

    def fire_flags(self) -> jax.Array:
        """(count,) bool: which faults fire on this device in this step."""
        return self._injector.fire_flags(self._at)


#: the seam of a step built without faults: no fault, so no point reads the context
NO_FAULTS = Armed(Injector((), ()), None)


def spiked(x: jax.Array, factor: jax.Array | None) -> jax.Array:
    """``x`` times :meth:`Injector.loss_factor`'s ``factor`` where it is not 1."""
    if factor is None:
        return x
    return jnp.where(factor != 1, x * factor.astype(x.dtype), x)


def poisoned(x: jax.Array, value: jax.Array | None) -> jax.Array:
    """``x`` with :meth:`Injector.leaf_value`'s ``value`` written in where it fires."""
    if value is None:
        return x
    return jnp.where(value != 0, value.astype(x.dtype), x)


def float_leaves(tree: PyTree) -> list[str]:
    """The ``keystr`` names of the float leaves of ``tree``: what an input fault may name."""
    paths = jax.tree_util.tree_leaves_with_path(tree)
    return [leaf_name(p) for p, x in paths if _is_float(x)]


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _sleep_if(on: np.ndarray, seconds: np.ndarray, token: np.ndarray) -> np.ndarray:
    if bool(on):
        time.sleep(float(seconds))
    return np.asarray(token, np.int32)

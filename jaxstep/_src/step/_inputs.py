"""What a step accepts, checked before anything runs: the state's structure and shapes
(learned from the first state), the batch's (validated once per new shape), and the
leaf names errors are written with. Host code only; nothing here is traced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.core import Batch
from jaxstep._src.core import TrainState
from jaxstep._src.core import processes
from jaxstep._src.core import validate
from jaxstep._src.core import warn
from jaxstep._src.core.names import keystrs as keystrs
from jaxstep._src.program import Options
from jaxstep._src.program import Plan
from jaxstep._src.program import float_leaves
from jaxstep._src.program import padding_of


def join_presplit(batch: Batch, n: int) -> Batch:
    """A pre-split ``(n, per_device, ...)`` batch as the global batch. ``n`` is the
    devices the batch is laid out for: the step's, or, once a device left the run,
    those it was laid out for before (``fit``'s carried rows).

    Raises:
      ValueError: a leaf is not ``(n, per_device, ...)``.
    """
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        shape: tuple[int, ...] = tuple(getattr(x, "shape", ()))
        if len(shape) < 2 or shape[0] != n:
            raise ValueError(
                f"presplit=True, but batch leaf {jax.tree_util.keystr(path) or 'batch'} "
                f"has shape {tuple(shape)}; a pre-split leaf is (n_devices={n}, "
                "per_device, ...)"
            )
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), batch)


def local_positions(devices: Sequence[jax.Device]) -> list[int]:
    """The positions of ``devices`` whose chunks this process's batches hold, in order:
    every one with one process."""
    if processes.spans_processes(devices):
        return processes.local_positions(devices)
    return list(range(len(devices)))


class Inputs:
    """The state and batch a step takes, and the names of their leaves.

    ``names`` holds the ``keystr``s of params, batch, checks and state leaves: params
    and state from the first state checked, input from the first batch, checks from
    the step's first output (:meth:`learn_checks`).
    """

    def __init__(self, options: Options):
        self.options = options
        # the options a state depends on, for "this state does not fit"
        spike = "on" if options.loss_spike else "off"
        self.describe = f"{options.backend} backend, loss_spike={spike}"
        self.stacked = options.backend == "pmap"  # state leaves carry a device axis
        self.names: dict[str, list[str]] = {
            "params": [],
            "input": [],
            "checks": [],
            "state": [],
            "model_state": [],
        }
        self._state_sig: Any = None
        self._batch_def: Any = None
        self._batch_key: Any = None
        self._batch_sig: list[tuple[Any, Any]] = []  # the first batch's (shape, dtype)s
        # how the first batch came: pre-split (joined here), or looking pre-split
        self._batch_presplit = False
        self._batch_looked_presplit = False
        self._warned: set[str] = set()
        #: set by a pre-split call (``presplit=True``): no "looks pre-split" warning
        self.presplit_warned = False
        #: rows per device of the last batch checked (as this process passes it)
        self.rows_per_device = 0

    def forget(self) -> None:
        """The next state and the next batch checked are learned afresh (a new
        ``init``): a fresh state is not held to an earlier run's batch layout."""
        self._state_sig = None
        self._batch_def = self._batch_key = None

    def for_options(self, options: Options) -> Inputs:
        """The inputs of the step rebuilt with ``options`` (``exclude_devices``): the
        same leaf names (the model did not change) and the same first batch (a leaf's
        change is told against the run's first batch, once per leaf over the run); the
        state's shapes are learned afresh, and the next batch is validated for the
        devices left."""
        inputs = Inputs(options)
        inputs.names = self.names
        inputs.presplit_warned = self.presplit_warned
        inputs.rows_per_device = self.rows_per_device
        inputs._batch_def, inputs._batch_sig = self._batch_def, self._batch_sig
        inputs._batch_presplit = self._batch_presplit
        inputs._batch_looked_presplit = self._batch_looked_presplit
        inputs._warned = self._warned  # one set for the run: a leaf is told of once
        return inputs

    def learn_checks(self, checks: Sequence[str]) -> None:
        self.names["checks"] = list(checks)

    def check_state(self, state: Any, *, built: bool = False) -> None:
        """Learns the first state's names and shape; checks every later one against it.
        ``built``: the state comes from this step's ``init``, placed by it and with its
        optimizer's state, so neither is checked again.

        Raises:
          TypeError: ``state`` is not a TrainState.
          ValueError: its structure or a leaf's shape/dtype differs from the first.
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"expected a jaxstep.TrainState, got {type(state).__name__}; build the "
                "first one with step.init(params)"
            )
        if not built:
            validate.alive(state)
            self._check_placement(state)
        leaves, treedef = jax.tree.flatten(state)
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
        if self._state_sig is None:
            # The first state: from init, or one this step did not build (a resume
            # from a checkpoint or another step). Learn its leaf names and shape
            # (names only: the structure is the same with pmap's device axis).
            self.names["params"] = keystrs(state.params)
            self.names["model_state"] = keystrs(state.model_state, "model_state")
            self.names["state"] = (
                keystrs(state.params, "params")
                + keystrs(state.opt_state, "opt_state")
                + self.names["model_state"]
            )
            self.options.injector.validate(
                {"grad": self.names["params"], "param": self.names["params"]}
            )
            if not built:
                self._check_opt_state(state)
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
                f"this state does not fit this step ({self.describe}): {what}; build the "
                "state with this step's init, or the step with the options of the one that "
                "made it"
            )

    def check_batch(self, batch: Batch, presplit: bool = False) -> list[Any]:
        """Validates a batch of a new structure or shape (one flatten otherwise);
        returns its leaves. ``presplit``: the batch was passed pre-split and joined; the
        first batch's layout is learned afresh when a first batch taken flat (with a
        warning to pass ``presplit=True``) is followed by one as told (:meth:`_relayout`).

        Raises:
          ValueError, TypeError: the batch does not split over the devices, or its
            structure differs from the first batch's.
        """
        leaves, treedef = jax.tree.flatten(batch)
        # Hot path: the same structure, shapes and dtypes as the last good batch: no walk.
        # (A device array's ``aval`` holds both as plain attributes: its own ``shape``
        # and ``dtype`` are Python properties, a call each per leaf and step.)
        avals = [getattr(x, "aval", x) for x in leaves]
        key = (treedef, *[(getattr(a, "shape", None), getattr(a, "dtype", None)) for a in avals])
        if key == self._batch_key:
            return leaves
        validate.examples_list(batch)
        n, what = self._feeding_devices(leaves[0] if leaves else None)
        validate.batch(batch, n, self.options.microbatches, what)
        looks = None if presplit else validate.looks_presplit(batch, n)
        if looks and not self.presplit_warned:
            self.presplit_warned = True
            warn(looks)
        if self._batch_def is None or self._relayout(treedef, leaves, presplit):
            self.options.injector.validate({"input": float_leaves(batch)})
            self._batch_def = treedef
            self.names["input"] = [name or "batch" for name in keystrs(batch)]
            # dtypes as the devices hold them (float64 is float32 without x64): a batch
            # placed ahead by fit's prefetch and the same batch from the host agree
            self._batch_sig = [(tuple(x.shape), _on_device(x.dtype)) for x in leaves]
            self._batch_presplit, self._batch_looked_presplit = presplit, looks is not None
        elif treedef != self._batch_def:
            raise ValueError(
                f"batch structure changed: the first batch was {self._batch_def}, this "
                f"one is {treedef}; every batch must have the same pytree structure"
            )
        else:
            self._check_leaves(leaves)
        self._batch_key = key
        self.rows_per_device = int(leaves[0].shape[0]) // n
        return leaves

    def _relayout(self, treedef: Any, leaves: Sequence[Any], presplit: bool) -> bool:
        """Whether this batch's layout replaces the first batch's: it comes pre-split
        and the first did not, or the first looked pre-split, ``(n, per_device, ...)``,
        and this one is its joined form, ``(n * per_device, ...)``, leaf for leaf (the
        loop joins pre-split batches itself under ``step_timeout``). The other way, a
        batch passed flat after pre-split ones is held to their joined layout: a
        pre-split batch without the option is refused with the fix."""
        if presplit and not self._batch_presplit:
            return True
        if not self._batch_looked_presplit or treedef != self._batch_def:
            return False
        return all(
            tuple(x.shape) == (shape[0] * shape[1], *shape[2:]) and _on_device(x.dtype) == dtype
            for (shape, dtype), x in zip(self._batch_sig, leaves, strict=True)
        )

    def _feeding_devices(self, first: Any) -> tuple[int, str]:
        """How many devices this process's batch is split over, and what to call them."""
        devices = self.options.devices
        if not processes.spans_processes(devices) or (
            isinstance(first, jax.Array) and not first.is_fully_addressable
        ):
            return len(devices), "devices"
        return len(processes.local_positions(devices)), "devices of this process"

    def _check_leaves(self, leaves: Sequence[Any]) -> None:
        """Each leaf against the first batch's: what may change between batches."""
        names = self.names["input"]
        for name, first, x in zip(names, self._batch_sig, leaves, strict=True):
            now = (tuple(x.shape), _on_device(x.dtype))
            if now == first:
                continue
            n = len(self.options.devices)
            warning = validate.changed_leaf(name or "batch", first, now, n)
            if warning is not None and name not in self._warned:
                self._warned.add(name)
                warn(warning)

    def _check_placement(self, state: TrainState) -> None:
        """The state's layout and devices match this step's (a state of the other
        backend, or placed on other devices, is refused with the fix)."""
        number = state.step
        ndim = getattr(number, "ndim", 0)
        fix = (
            "move it with state = step.place_state(other_step.host_state(state)) (any "
            "device count, either backend), or jaxstep.restore(step, checkpoint_dir)"
        )
        if ndim != (1 if self.stacked else 0):
            made, want = ("pmap", "shard_map") if ndim else ("shard_map", "pmap")
            raise ValueError(
                f"this state does not fit this step: it was placed for a {made} step "
                f"(state.step has shape {getattr(number, 'shape', ())}), and this step uses "
                f"backend={want!r}: {fix}"
            )
        if isinstance(number, jax.Array):
            held = {int(d.id) for d in number.sharding.device_set}  # type: ignore[attr-defined]
            want_ids = {d.id for d in self.options.mesh_devices}
            if held != want_ids:
                raise ValueError(
                    f"this state does not fit this step: it lives on devices {sorted(held)}, "
                    f"and this step runs on devices {sorted(want_ids)}: {fix}"
                )

    def _check_opt_state(self, state: TrainState) -> None:
        """``state.opt_state`` is what this step's optimizer builds for these params."""
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                tuple(x.shape)[1:] if self.stacked else x.shape, x.dtype
            ),
            state.params,
        )
        if padding_of(self.options) is not None:  # padded leaves: as the optimizer sees them
            params = Plan.of(self.options, state).grad_view(params)
        try:
            want = jax.eval_shape(self.options.optimizer.init, params)
        except Exception:  # an optimizer whose init cannot be traced: not checked
            return
        got_leaves, got_def = jax.tree.flatten(state.opt_state)
        want_leaves, want_def = jax.tree.flatten(want)
        got_def, want_def = str(got_def), str(want_def)
        fix = (
            "the state was made by a step with another optimizer or for other params: "
            "build it with this step's init (state = step.init(params)), or build the step "
            "with the optimizer the state was made with"
        )
        if got_def != want_def:
            raise ValueError(
                f"this state does not fit this step: state.opt_state does not match its "
                f"optimizer: expected "
                f"{_short(want_def)}, got {_short(got_def)}; {fix}"
            )
        names = keystrs(state.opt_state, "opt_state")
        for name, a, b in zip(names, got_leaves, want_leaves, strict=True):
            shape = tuple(a.shape)[1:] if self.stacked else tuple(a.shape)
            if shape != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
                raise ValueError(
                    f"this state does not fit this step: state.opt_state leaf {name} has shape "
                    f"{shape} {a.dtype}, but this "
                    f"step's optimizer builds {tuple(b.shape)} {b.dtype} for these params; "
                    f"{fix}"
                )


def _short(treedef: Any, limit: int = 160) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[:limit] + "..."


def _on_device(dtype: Any) -> np.dtype:
    """``dtype`` as a device holds it (``jax.device_put`` canonicalises it)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))

"""What a step accepts, checked before anything runs: the state's structure and shapes
(learned from the first state), the batch's (validated once per new shape), and the
leaf names errors are written with. Host code only; nothing here is traced."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxstep.core import Batch
from jaxstep.core import PyTree
from jaxstep.core import TrainState
from jaxstep.core import _processes as processes
from jaxstep.core import _validate as validate
from jaxstep.program import Options
from jaxstep.program import float_leaves


def keystrs(tree: PyTree, prefix: str = "") -> list[str]:
    """``prefix + keystr(path)`` of every leaf of ``tree``, in leaf order."""
    return [prefix + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def join(batch: Batch, n: int) -> Batch:
    """A pre-split ``(n, per_device, ...)`` batch as the global batch.

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
        #: rows per device of the last batch checked (as this process passes it)
        self.rows_per_device = 0

    def forget_state(self) -> None:
        """The next state checked is learned afresh (a new ``init``)."""
        self._state_sig = None

    def learn_checks(self, checks: Sequence[str]) -> None:
        self.names["checks"] = list(checks)

    def check_state(self, state: Any) -> None:
        """Learns the first state's names and shape; checks every later one against it.

        Raises:
          TypeError: ``state`` is not a TrainState.
          ValueError: its structure or a leaf's shape/dtype differs from the first.
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"expected a jaxstep.TrainState, got {type(state).__name__}; build the "
                "first one with step.init(params)"
            )
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

    def check_batch(self, batch: Batch) -> list[Any]:
        """Validates a batch of a new structure or shape (one flatten otherwise);
        returns its leaves.

        Raises:
          ValueError, TypeError: the batch does not split over the devices, or its
            structure differs from the first batch's.
        """
        leaves, treedef = jax.tree.flatten(batch)
        # Hot path: the same structure and shapes as the last good batch need no walk.
        key = (treedef, tuple(getattr(x, "shape", None) for x in leaves))
        if key == self._batch_key:
            return leaves
        n, what = self._feeding_devices(leaves[0] if leaves else None)
        validate.batch(batch, n, self.options.microbatches, what)
        if self._batch_def is None:
            self.options.injector.validate({"input": float_leaves(batch)})
            self._batch_def = treedef
            self.names["input"] = keystrs(batch)
        elif treedef != self._batch_def:
            raise ValueError(
                f"batch structure changed: the first batch was {self._batch_def}, this "
                f"one is {treedef}; every batch must have the same pytree structure"
            )
        self._batch_key = key
        self.rows_per_device = int(leaves[0].shape[0]) // n
        return leaves

    def _feeding_devices(self, first: Any) -> tuple[int, str]:
        """How many devices this process's batch is split over, and what to call them."""
        devices = self.options.devices
        if not processes.spans_processes(devices) or (
            isinstance(first, jax.Array) and not first.is_fully_addressable
        ):
            return len(devices), "devices"
        return len(processes.local_positions(devices)), "devices of this process"

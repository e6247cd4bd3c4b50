"""Helpers for tests, notebooks and the demo: fake CPU devices, injected faults and
silently corrupted replicas."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import numpy as np

from jaxstep.faults import Fault
from jaxstep.state import TrainState
from jaxstep.step import TrainStep

__all__ = ["Fault", "corrupt_replica", "replicas", "set_cpu_devices"]


def set_cpu_devices(n: int) -> None:
    """Gives this process ``n`` fake CPU devices. Call it before JAX starts a backend.

    Raises:
      RuntimeError: a backend already runs with another device count.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    with contextlib.suppress(RuntimeError):  # a backend is up already: checked below
        jax.config.update("jax_num_cpu_devices", n)
    have = len(jax.devices("cpu"))
    if have != n:
        raise RuntimeError(
            f"JAX already started with {have} CPU devices, wanted {n}: call "
            "jaxstep.testing.set_cpu_devices before anything uses JAX (or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n})"
        )


def corrupt_replica(
    step: TrainStep, state: TrainState, device_id: int, leaf: str, *, ulps: int = 1
) -> TrainState:
    """Silent data corruption: ``device_id``'s copy of one leaf moves by ``ulps`` units
    in the last place (its first element), every other copy stays as it was.

    Args:
      step: the step that owns ``state``.
      state: a state from ``step``; not modified.
      device_id: the ``jax.Device.id`` whose replica is corrupted.
      leaf: a name from ``step.names["state"]``, e.g. ``"params['dense1']['kernel']"``.
      ulps: how many representable values to move (>= 1).
    """
    names = step.names["state"]
    if leaf not in names:
        raise ValueError(f"unknown state leaf {leaf!r}; the leaves are {names}")
    ids = [d.id for d in step.devices]
    if device_id not in ids:
        raise ValueError(f"device {device_id} is not among the step's devices {ids}")
    target = step.devices[ids.index(device_id)]
    leaves, treedef = jax.tree.flatten((state.params, state.opt_state))
    k = names.index(leaf)
    x = leaves[k]
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"leaf {leaf!r} has dtype {x.dtype}; pick a float leaf")

    def nudge(data: np.ndarray) -> np.ndarray:
        data = np.array(data, copy=True)
        flat = data.reshape(-1)
        for _ in range(ulps):
            flat[0] = np.nextafter(flat[0], np.inf, dtype=flat.dtype)
        return data

    shards = [
        jax.device_put(nudge(s.data) if s.device == target else np.asarray(s.data), s.device)
        for s in x.addressable_shards
    ]
    leaves[k] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    params, opt_state = jax.tree.unflatten(treedef, leaves)
    return state.replace(params=params, opt_state=opt_state)  # type: ignore[attr-defined]


def replicas(step: TrainStep, tree: Any) -> list[Any]:
    """Each device's own copy of a replicated (or pmap-stacked) pytree, as numpy."""
    return [step.local_copy(tree, i) for i in range(len(step.devices))]

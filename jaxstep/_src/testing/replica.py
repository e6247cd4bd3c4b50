"""Replicas, read and corrupted: each device's own copy of a replicated pytree, and
silent data corruption of one copy (what ``Status.DIVERGED`` catches)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxstep._src.core import TrainState
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of


def corrupt_replica(
    step: TrainStep, state: TrainState, device_id: int, leaf: str, *, ulps: int = 1
) -> TrainState:
    """Silent data corruption: ``device_id``'s copy of one leaf moves by ``ulps`` units
    in the last place (its first element), every other copy stays as it was.

    Args:
      step: the step that owns ``state``.
      state: a state from ``step``; not modified.
      device_id: the ``jax.Device.id`` whose replica is corrupted (under
        ``model_parallel`` any device of a group: its block of a leaf split over the
        model axis, or its own copy of a whole one).
      leaf: a name from ``step.names["state"]``: a parameter
        (``"params['Dense_0']['kernel']"``, or as ``Fault`` and ``err.leaf`` write it,
        ``"['Dense_0']['kernel']"``), an optimizer state leaf (``"opt_state[0].mu['w']"``)
        or a model state leaf (``"model_state['batch_stats']['mean']"``, e.g. BatchNorm
        statistics).
      ulps: how many representable values to move (>= 1).

    Returns:
      A new state, placed as ``state`` is, whose replica on ``device_id`` differs.

    Raises:
      ValueError: an unknown leaf or device, a leaf that is not float, or a leaf held
        as shards without twins (``shard_state`` with ``replicas=1``: a shard has one
        owner, no replica; with ``replicas=k`` the device's shard is corrupted and its
        twins on the other groups stay as they were; under ``model_parallel`` a block
        the model axis does not split has a copy on each device of its group).

    Example:
      >>> from jaxstep.testing import corrupt_replica, replicas, tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> state = tiny.state()
      >>> bad = corrupt_replica(tiny.step, state, tiny.step.devices[1].id, "['w']")
      >>> [bool((c["w"] == 0).all()) for c in replicas(tiny.step, bad.params)][:3]
      [True, False, True]
    """
    names = step.names["state"]
    k = state_leaf_index(names, leaf)
    every = list(step.options.mesh_devices)  # under model_parallel, any device of a group
    ids = [d.id for d in every]
    if device_id not in ids:
        raise ValueError(f"device {device_id} is not among the step's devices {ids}")
    target = every[ids.index(device_id)]
    # the order of step.names["state"]
    leaves, treedef = jax.tree.flatten((state.params, state.opt_state, state.model_state))
    x = leaves[k]
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"leaf {leaf!r} has dtype {x.dtype}; pick a float leaf")
    if (
        isinstance(x, jax.Array)
        and step.options.shard_state is not None  # (pmap stacks copies: each its own)
        and _only_copy(x, target)
    ):
        whole = [n for n, y in zip(names, leaves, strict=True) if y.sharding.is_fully_replicated]
        raise ValueError(
            f"leaf {leaf!r} is sharded over the devices (shard_state="
            f"{step.options.shard_state!r}): each device holds the only copy of its shard, "
            "so there is no replica to corrupt (and none to compare: a bad shard shows in "
            f"the checks of what it computes; make_train_step(replicas=k) gives every "
            f"shard k - 1 twins). The replicated leaves are {whole}"
        )

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
    params, opt_state, model_state = jax.tree.unflatten(treedef, leaves)
    return state.replace(  # type: ignore[attr-defined]
        params=params, opt_state=opt_state, model_state=model_state
    )


def _only_copy(x: jax.Array, target: jax.Device) -> bool:
    """Whether ``target`` holds the only copy of its block of ``x`` (a shard with no
    twin: no other device, in any process, holds the same block; under
    ``model_parallel`` the devices of a group each hold a copy of a block the model
    axis does not split)."""
    where = x.sharding.devices_indices_map(x.shape)
    key = lambda index: tuple((s.start, s.stop, s.step) for s in index)  # noqa: E731
    mine = key(where[target])
    return sum(key(index) == mine for index in where.values()) == 1


def state_leaf_index(names: list[str], leaf: str) -> int:
    """The position of ``leaf`` in a step's ``names["state"]``; a parameter may be
    named without ``params`` in front, as ``Fault`` and ``err.leaf`` name it."""
    for name in (leaf, f"params{leaf}"):
        if name in names:
            return names.index(name)
    raise ValueError(
        f"unknown state leaf {leaf!r}; the leaves are {names} (a parameter may also be "
        "named without 'params' in front, as err.leaf names it)"
    )


def replicas(step: TrainStep, tree: Any) -> list[Any]:
    """Each device's own copy of a replicated (or pmap-stacked) pytree.

    Args:
      step: the step that placed ``tree``.
      tree: a replicated pytree from ``step`` (a ``TrainState``, ``state.params``, ...).

    Returns:
      One copy a device, as numpy, in the order of ``step.devices``.

    Example:
      >>> from jaxstep.testing import replicas, tiny_step
      >>> tiny = tiny_step(divergence_every=None)
      >>> copies = replicas(tiny.step, tiny.state().params)
      >>> len(copies), copies[5]["w"].shape
      (8, (3, 1))
    """
    runtime = runtime_of(step)
    return [runtime.read_at(tree, i) for i in range(len(step.devices))]

"""Training on without some devices (``TrainStep.exclude_devices``): the runtime on the
devices left (:func:`fewer`), its options, and the host-side move of a state onto it.
Host code only; nothing here is traced."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxstep._src.core import TrainState
from jaxstep._src.core import from_host
from jaxstep._src.core import warn
from jaxstep._src.core.names import keystrs
from jaxstep._src.program import Options
from jaxstep._src.program import Plan
from jaxstep._src.program import nbytes_per_device

#: the per-device arrays of ``state.monitor``: (keys, the axis that runs over the devices)
PER_DEVICE: tuple[tuple[tuple[str, ...], int], ...] = (
    (("spike", "losses"), 1),  # LossSpike's window, (window, n)
    (("drops",), 0),  # on_failure="drop": steps in a row each device was left out, (n,)
    (("repairs",), 0),  # and how often its replica was repaired, (n,)
)


def fewer(runtime: Any, device_ids: Sequence[int], state: TrainState) -> tuple[Any, TrainState]:
    """``Runtime.without``: a new runtime of ``runtime``'s class on the devices left when
    ``device_ids`` go, and ``state`` (checked) moved onto them through the host: one
    copy read from a device that stays, its per-device monitor columns kept for the
    devices left, the layout kept (:func:`keep_layout`), placed on the new devices."""
    old: Options = runtime.options
    keep = kept_positions(old, device_ids)
    options, kept_faults = smaller_options(old, keep)
    here = jax.process_index()  # a copy this process holds, of a device that stays
    source = next(i for i in keep if runtime.devices[i].process_index == here)
    host = shrink_state(runtime.backend.read_at(state, source), keep)
    options = keep_layout(old, options, host)
    warn_resharded(old, options, host)
    warn_groups(old, options, device_ids)
    extras = runtime.extras
    smaller = type(runtime)(
        options,
        inputs=runtime.inputs,
        origin=runtime.devices if runtime.origin is None else runtime.origin,
        fired=extras.fired()[kept_faults] if extras.n_faults else None,
    )
    placed = smaller.backend.place_state(from_host(host))
    smaller.inputs.check_state(placed, built=True)  # learns the new state's shapes
    smaller.continues(placed, int(host.step))
    return smaller, placed


def kept_positions(options: Options, device_ids: Sequence[int]) -> list[int]:
    """The positions of ``options.devices`` that stay when ``device_ids`` go.

    Raises:
      TypeError: an id is not an int.
      ValueError: an id is not one of the step's devices; no device would remain; with
        several processes, one of them would keep none of its devices.
    """
    if isinstance(device_ids, int | str | jax.Device):
        raise TypeError(
            f"device_ids must be a sequence of jax.Device.id ints, got {device_ids!r}; "
            "e.g. step.exclude_devices([3], state)"
        )
    ids = options.device_ids
    for d in device_ids:
        if isinstance(d, bool) or not isinstance(d, int | np.integer):
            raise TypeError(f"device_ids must hold jax.Device.id ints, got {d!r}")
        if not options.group_ids(int(d)):
            every = [x.id for x in options.mesh_devices]
            raise ValueError(
                f"device {d} is not one of this step's devices {every}: pass ids "
                "from [d.id for d in step.devices]"
            )
    # under model_parallel a device goes with its model group (the group's first names it)
    gone = {options.group_ids(int(d))[0] for d in device_ids}
    keep = [i for i, d in enumerate(ids) if d not in gone]
    if options.replicas > 1:  # a group goes whole: its shards have no home without it
        m = options.group_size
        groups = {i // m for i, d in enumerate(ids) if d in gone}
        keep = [i for i in keep if i // m not in groups]
    if not keep:
        raise ValueError(
            f"excluding devices {sorted(gone)} leaves this step no device: keep at least "
            "one (build a new step with make_train_step(devices=[...]) to move elsewhere)"
        )
    devices = options.devices
    held = {d.process_index for d in devices}
    left = {devices[i].process_index for i in keep}
    if held != left:
        lost = sorted(held - left)
        raise ValueError(
            f"excluding devices {sorted(gone)} leaves process(es) {lost} with no device of "
            "this step; every process needs one (it feeds its own rows): restart the run "
            "without that process instead (python -m jaxstep.launch --restarts)"
        )
    return keep


def smaller_options(options: Options, keep: Sequence[int]) -> tuple[Options, list[int]]:
    """The options of the step on ``devices[keep]``, and the indices of the faults it
    keeps (a fault on a device that goes can no longer fire: it is let go). An
    explicit ``max_dropped`` above the new limit becomes ``n - 1``; None still means
    the default for the new count. Under ``replicas`` the groups left (whole groups
    go: :func:`kept_positions`); with one group the layout is kept by
    :func:`keep_layout`."""
    devices = [options.devices[i] for i in keep]
    ids = {d.id for i in keep for d in options.groups[i]}
    kept_faults = [k for k, f in enumerate(options.faults) if f.device_id in ids]
    max_dropped = options.max_dropped
    if max_dropped is not None:
        max_dropped = min(max_dropped, len(devices) - 1)
    replicas = len(devices) // options.group_size if options.replicas > 1 else 1
    smaller = dataclasses.replace(
        options,
        devices=devices,
        faults=[options.faults[k] for k in kept_faults],
        max_dropped=max_dropped,
        replicas=replicas,
    )
    return smaller, kept_faults


def keep_layout(old: Options, options: Options, host: TrainState) -> Options:
    """``options`` (the smaller step's) with the layout of ``old`` kept for ``host`` (a
    one-copy host state, logical shapes) under ``shard_state`` with one group: each
    leaf keeps its axis (the rule is not asked again), and a leaf whose axis no longer
    divides by the devices left is held padded to the next multiple
    (:class:`jaxstep._src.program.Kept`): the state stays sharded, never made whole. Under
    ``replicas`` > 1 a group leaves whole and the groups left keep their layout as it
    is: ``options`` unchanged."""
    if options.shard_state is None or old.replicas > 1:
        return options
    plan = Plan.of(old, host)
    if not plan.sharded:
        return options
    kept = plan.keep(host, old.optimizer, options.group_size)
    return dataclasses.replace(options, kept=kept)


def warn_groups(old: Options, options: Options, device_ids: Sequence[int]) -> None:
    """Under ``replicas``: says which healthy devices left with the groups of
    ``device_ids`` and what the step runs on now."""
    if old.replicas == 1:
        return
    m = old.group_size
    every = lambda o: [d.id for d in o.mesh_devices]  # noqa: E731  (model groups whole)
    left = every(options)
    gone = sorted({int(i) for i in device_ids} | (set(every(old)) - set(left)))
    twins = (
        f"each shard keeps {options.replicas - 1} twin(s)"
        if options.replicas > 1
        else "with one group left the shards have no twins (the replica check compares none)"
    )
    said = ", ".join(str(int(i)) for i in device_ids)
    over = f"{m} devices" if old.model_parallel == 1 else f"{m} model groups"
    warn(
        f"replicas={old.replicas}: device {said} leaves with its group (devices "
        f"{', '.join(map(str, gone))}): a group holds one whole copy of the sharded state, "
        f"split over its {over}, and leaves whole, so the state stays sharded as it "
        f"was. Training goes on on {options.replicas} group(s) of {over} (devices "
        f"{', '.join(map(str, left))}); {twins}. To use the healthy devices of that group "
        "again, restart from the latest checkpoint on them (jaxstep.restore restores onto "
        "any layout)",
    )


def shrink_state(host: TrainState, keep: Sequence[int]) -> TrainState:
    """A one-replica host copy of a state with the per-device columns of its monitor
    (:data:`PER_DEVICE`) kept for the positions ``keep`` only, and ``halted`` cleared."""
    monitor = _copy_dicts(host.monitor)
    index = np.asarray(keep)
    for keys, axis in PER_DEVICE:
        *path, last = keys
        parent = monitor
        for key in path:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and parent.get(last) is not None:
            parent[last] = np.take(np.asarray(parent[last]), index, axis=axis)
    cleared: Any = np.zeros((), bool)  # a host copy: numpy leaves
    return dataclasses.replace(host, monitor=monitor, halted=cleared)


def _copy_dicts(tree: Any) -> Any:
    """``tree``'s nested dicts copied (their leaves shared): changed without touching
    the caller's."""
    if isinstance(tree, dict):
        return {k: _copy_dicts(v) for k, v in tree.items()}
    return tree


def warn_resharded(old: Options, options: Options, host: TrainState) -> None:
    """Under ``shard_state``: warns when leaves of the state laid out on the devices of
    ``options`` (from those of ``old``) are held padded, their axis no longer dividing
    by the devices, naming them and the bytes per device before and after."""
    if options.shard_state is None:
        return
    was, now = Plan.of(old, host), Plan.of(options, host)
    names, pads = _names(host), [*now.param_pads, *now.opt_pads]
    padded = [name for name, p in zip(names, pads, strict=False) if p is not None]
    axes = zip(names, (*was.params, *was.opt), (*now.params, *now.opt), strict=True)
    whole = [name for name, a, b in axes if a is not None and b is None]
    if not padded and not whole:
        return
    old_bytes = nbytes_per_device(host, was, old.group_size)
    new = nbytes_per_device(now.physical(host), now, options.group_size)
    shown = ", ".join(padded[:4]) + (f" and {len(padded) - 4} more" if len(padded) > 4 else "")
    warn(
        f"shard_state={options.shard_state!r} on {options.n} devices (from {old.n}): "
        f"{len(padded)} leaves sharded before no longer divide over {options.n} devices "
        f"and stay sharded along the same axis, padded with zeros to a multiple of "
        f"{options.n} ({shown}); the state takes {_mb(new)} per device, {_mb(old_bytes)} "
        "before. The padding never reaches the loss, the optimizer's moments (they stay "
        "0), a checkpoint or host_state; an elementwise optimizer's update of those "
        "leaves is exact (Adam, SGD, a global-norm clip), while a factored second "
        "moment or a mean over a leaf sees the zeros in its statistics"
        + (
            f"; {len(whole)} optimizer-state leaves the optimizer builds with the same "
            f"shape for the padded parameters are whole ({', '.join(whole[:4])})"
            if whole
            else ""
        ),
    )


def _names(host: TrainState) -> list[str]:
    return keystrs(host.params, "params") + keystrs(host.opt_state, "opt_state")


def _mb(n: int) -> str:
    """``n`` bytes in the unit that shows them (a small state in KiB or bytes, not
    "0.00 MiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"

"""A checkpoint read back (:class:`Loaded`: one host copy of the state, its layout and
metadata) and made to fit this run's step (:func:`conform`): the same leaves, shapes and
dtypes as the step's state, the per-device memories for this step's devices and
policy. :func:`jaxstep.restore` (:mod:`jaxstep._src.checkpoint._store`) places the result."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxstep._src.checkpoint import _blocks as blocks
from jaxstep._src.checkpoint._layout import Layout
from jaxstep._src.checkpoint._layout import local_copy
from jaxstep._src.checkpoint._position import Position
from jaxstep._src.core import TrainState
from jaxstep._src.core import warn
from jaxstep._src.program import drop_memory
from jaxstep._src.step import Runtime

__all__ = ["Loaded", "conform"]


@dataclasses.dataclass
class Loaded:
    """A checkpoint read back: one host copy of the state and its metadata."""

    host: TrainState | None  # of numpy arrays (and typed keys); None: not rebuildable
    leaves: list[Any]
    layout: Layout
    meta: dict[str, Any]
    path: str

    @property
    def position(self) -> Position | None:
        """This process's data position (each process of a multi-process run has its
        own; they were all saved)."""
        by_process = self.meta.get("data_by_process")
        data = self.meta.get("data")
        if by_process is not None:
            data = by_process.get(str(jax.process_index()), data)
        return None if data is None else Position.from_json(data)


def conform(step: Runtime, loaded: Loaded, template: TrainState | None = None) -> TrainState:
    """The loaded host state, checked against (and shaped like) this run's state.

    ``step``: the runtime of the step it is restored for. ``template`` (a state of this
    step, e.g. from ``step.init``) is what the state must
    look like: same leaf names, shapes and dtypes. The per-device monitor windows are the
    one thing that may differ (another device count): they restart, with a warning.
    Without a template the leaf names of the step's parameters and optimizer state are
    compared when the step has seen a state.

    Raises:
      ValueError: the checkpoint holds another model's state; the message names the
        leaves that differ.
    """
    saved = loaded.layout
    leaves = list(loaded.leaves)
    if template is not None:
        want = Layout.of(template, stacked=step.stacked, pads=step.backend.pads(template))
        have = dict(zip(saved.names, zip(saved.shapes, saved.dtypes, strict=True), strict=True))
        differ = []
        fresh: list[Any] | None = None
        out: list[Any] = []
        for i, name in enumerate(want.names):
            spec = (want.shapes[i], want.dtypes[i])
            if name not in have and _of_drop(name):  # saved by a run without on_failure="drop"
                if fresh is None:
                    fresh = _fresh(step, template)
                out.append(fresh[i])
                continue
            if name not in have:
                differ.append(f"{name} (not in the checkpoint)")
                continue
            if have[name] != spec and name.startswith(".monitor"):
                if fresh is None:  # per-device windows: they restart on a new device count
                    fresh = _fresh(step, template)
                    warn(
                        f"the checkpoint's monitor windows are for another device count; "
                        f"they restart here ({len(step.devices)} devices)",
                    )
                out.append(fresh[i])
                continue
            if have[name] != spec:
                (was, was_dtype), (now, now_dtype) = have[name], spec
                differ.append(f"{name} (saved {was} {was_dtype}, here {now} {now_dtype})")
                continue
            out.append(leaves[saved.names.index(name)])
        differ += [
            f"{n} (only in the checkpoint)"
            for n in saved.names
            if n not in want.names and not _of_drop(n)
        ]
        _raise_if(differ, loaded)
        return want.build(out)
    known = set(step.names.get("state", ()))
    if known:
        # The step names the leaves of some fields (params, opt_state, model_state, ...).
        covered = {_field(n) for n in known}
        saved_names = {n[1:] for n in saved.names if _field(n[1:]) in covered}
        order = list(dict.fromkeys([n[1:] for n in saved.names] + list(step.names["state"])))
        _raise_if(
            [f"{n} (not in the checkpoint)" for n in order if n in known - saved_names]
            + [f"{n} (only in the checkpoint)" for n in order if n in saved_names - known],
            loaded,
        )
    if loaded.host is None:
        saved.build(leaves)  # raises, saying why
    host = loaded.host
    assert host is not None
    spike = step.options.loss_spike
    if spike is not None and "spike" in host.monitor:
        n = len(step.devices)
        saved_ids = list(loaded.meta.get("device_ids") or [])
        ids = [d.id for d in step.devices]
        losses = host.monitor["spike"]["losses"]
        if (
            losses.shape[1] != n
            and len(saved_ids) == losses.shape[1]
            and set(ids) <= set(saved_ids)
        ):
            # saved before some devices left the run (fit(recover=...)): theirs stay
            keep = [saved_ids.index(i) for i in ids]
            spike_memory = {**host.monitor["spike"], "losses": np.asarray(losses)[:, keep]}
            host = dataclasses.replace(host, monitor={**host.monitor, "spike": spike_memory})
        elif losses.shape[1] != n:
            warn(
                "the checkpoint's monitor windows are for another device count; they "
                f"restart here ({n} devices)",
            )
            host = dataclasses.replace(
                host, monitor={**host.monitor, "spike": jax.device_get(spike.init(n))}
            )
    return _drop_fields(step, host)


def _fresh(step: Runtime, template: TrainState) -> list[Any]:
    """The template's leaves on the host (its monitor and drop fields are what is
    used: a leaf sharded across processes comes as a placeholder)."""
    leaves = local_copy(template, stacked=step.stacked)
    return blocks.to_host(leaves, step.backend.pads(template))[0]


def _of_drop(name: str) -> bool:
    """A saved leaf of ``on_failure="drop"``'s memory: a run under another policy has
    none, so a checkpoint may lack it (it starts at zero) or hold it (it is let go)."""
    return name == ".total_drops" or name.startswith((".monitor['drops']", ".monitor['repairs']"))


def _drop_fields(step: Runtime, host: TrainState) -> TrainState:
    """``host`` with the drop policy's fields as this step's policy wants them: zeros
    when the checkpoint has none (or counts for another device count), none under the
    other policies."""
    monitor = {k: v for k, v in host.monitor.items() if k not in ("drops", "repairs")}
    if step.options.on_failure != "drop":
        return dataclasses.replace(host, total_drops=None, monitor=monitor)
    n = len(step.devices)
    fresh = jax.device_get(drop_memory(n))
    for key in ("drops", "repairs"):
        saved = host.monitor.get(key)
        monitor[key] = saved if saved is not None and saved.shape == (n,) else fresh[key]
    total: Any = host.total_drops  # a host copy: numpy
    if total is None:
        total = np.zeros((), np.int32)
    return dataclasses.replace(host, total_drops=total, monitor=monitor)


def _field(name: str) -> str:
    """The TrainState field of a leaf name: ``opt_state`` of ``opt_state[0].mu['w']``."""
    return name.split("[", 1)[0].split(".", 1)[0]


def _raise_if(differ: list[str], loaded: Loaded) -> None:
    if differ:
        shown = "; ".join(differ[:8]) + (f"; and {len(differ) - 8} more" if len(differ) > 8 else "")
        raise ValueError(
            f"checkpoint {loaded.path} holds another model's state: {shown}. Restore it with "
            "the model, optimizer and step options that made it, or use a new checkpoint_dir"
        )

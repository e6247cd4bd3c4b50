"""Checkpoints that lose nothing: the whole ``TrainState`` and the data position, saved
with orbax; restored onto any device count or backend; an emergency save on a failure.

:func:`jaxstep.fit` copies one replica of the state on device at each checkpoint step
(one dispatch, no wait) and hands the copy to a writer thread once that step's replica
check has passed: only verified states reach the disk, and training never waits for a
write. Layout of a checkpoint directory (one orbax ``CheckpointManager`` root)::

    <dir>/<step>/state/   the state's leaves (numpy, one replica, PRNG keys as key data)
    <dir>/<step>/meta/    JSON: verified, data position, leaf names, devices, backend, ...
    <dir>/emergency/step_<k>/<k>/{state,batch,meta,report}/   one per failure
    <dir>/emergency/step_<k>/process_<i>/   several processes: each one's rows, report

With several processes (``jax.distributed``) one process writes each checkpoint and
every process restores it; see :mod:`jaxstep.checkpoint._coordination`. ``checkpoint_dir`` must
then be storage every process sees (a bucket, a shared file system).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

import jax
import numpy as np

from jaxstep.checkpoint import _coordination as coordination
from jaxstep.checkpoint._layout import Layout
from jaxstep.checkpoint._layout import local_copy
from jaxstep.checkpoint._position import Position
from jaxstep.core import TrainState
from jaxstep.program import drop_memory

if TYPE_CHECKING:
    from jaxstep.step import TrainStep

log = logging.getLogger("jaxstep")

FORMAT = 1
EMERGENCY = "emergency"
_TMP = ".orbax-checkpoint-tmp"


@functools.cache
def _ocp() -> Any:
    """orbax.checkpoint, imported on first use: it adds about a second to ``import
    jaxstep``, which most scripts and test processes never need."""
    import orbax.checkpoint

    return orbax.checkpoint


def as_path(directory: str | os.PathLike[str]) -> Any:
    """A checkpoint location: a local path (made absolute), or for a URL such as
    ``gs://bucket/run`` an ``etils.epath.Path``, which is what orbax itself writes to."""
    text = os.fspath(directory)
    if "://" in text:
        from etils import epath

        return epath.Path(text)
    return Path(text).absolute()


class Store:
    """One checkpoint directory (an orbax ``CheckpointManager`` root), written by one
    thread at a time. ``keep``: how many checkpoints to keep (None: all); ``create``:
    make the directory if it is missing."""

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int | None = None, create: bool = False
    ):
        self.directory = as_path(directory)
        ocp = _ocp()
        extra: dict[str, Any] = {}
        if jax.process_count() > 1:
            # One process writes each checkpoint (the state is replicated) and every
            # process reads: each manager acts for its own process alone, so no orbax
            # barrier ever waits for a peer (one that is lost would leave it hanging).
            me = jax.process_index()
            extra["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}
            )
            if create:
                self.directory.mkdir(parents=True, exist_ok=True)
                create = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=create, enable_async_checkpointing=False, **extra
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """The steps in the directory now (read again: another process, or a store
        opened earlier, may have written since this one was opened)."""
        self._mngr.reload()  # all_steps(read=True) does the same, and logs a deprecation
        return sorted(self._mngr.all_steps())

    def save(self, number: int, items: dict[str, Any]) -> None:
        """Writes ``items`` (name -> list of numpy arrays, or a JSON-able dict) as step
        ``number``; orbax writes to a temporary directory and renames it when complete."""
        ocp = _ocp()
        args = {
            name: ocp.args.JsonSave(v)
            if isinstance(v, dict)
            else ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(v)})
            for name, v in items.items()
        }
        self._mngr.save(number, args=ocp.args.Composite(**args), force=True)

    def read(self, number: int, *arrays: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """(meta, {item: leaves}) of step ``number``."""
        ocp = _ocp()
        args = {"meta": ocp.args.JsonRestore()}
        args.update({name: ocp.args.StandardRestore() for name in arrays})
        got = self._mngr.restore(number, args=ocp.args.Composite(**args))
        leaves = {name: [got[name][k] for k in sorted(got[name])] for name in arrays}
        return dict(got["meta"]), leaves

    def meta(self, number: int) -> dict[str, Any] | None:
        """Step ``number``'s metadata, or None when it cannot be read."""
        try:
            return self.read(number)[0]
        except Exception:
            return None

    def latest_verified(self) -> int | None:
        verified = (n for n in reversed(self.steps()) if (self.meta(n) or {}).get("verified"))
        return next(verified, None)

    def half_written(self) -> list[str]:
        """Directories of writes that never completed (a killed process leaves them)."""
        return sorted(p.name for p in self.directory.iterdir() if _TMP in p.name)

    def close(self) -> None:
        self._mngr.close()


def _open(directory: str | os.PathLike[str]) -> Store:
    path = as_path(directory)
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint directory at {str(path)!r}; pass the checkpoint_dir that "
            "fit(..., checkpoint_dir=...) wrote"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint_dir {str(path)!r} is a file, not a directory")
    try:
        list(path.iterdir())
    except OSError as err:
        raise OSError(f"cannot read checkpoint directory {str(path)!r}: {err.strerror}") from err
    return Store(path)


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


def load(directory: str | os.PathLike[str], *, at: int | None = None) -> Loaded:
    """Reads the latest verified checkpoint of ``directory`` (or step ``at``).

    A write killed half-way is never read (orbax renames a step's directory only once
    it is complete); one whose files cannot be read is passed over, with a warning,
    for the previous one.

    Raises:
      FileNotFoundError, NotADirectoryError, OSError: no readable directory there.
      ValueError: no checkpoint there, or no step ``at``.
    """
    store = _open(directory)
    try:
        return _load(store, at)
    finally:
        store.close()


def _load(store: Store, at: int | None) -> Loaded:
    steps = store.steps()
    half = store.half_written()
    if at is not None and at not in steps:
        raise ValueError(
            f"no checkpoint of step {at} in {str(store.directory)!r}; it holds steps {steps}"
            + (f" (and unfinished writes {half}, never read)" if half else "")
        )
    if not steps and any(store.directory.glob("process_*")):
        raise _NoState(
            f"the emergency save {store.directory} holds no state (the devices hung or a "
            "process was lost, and it could not be read): restore the latest verified "
            "checkpoint of the run instead"
        )
    if not steps:
        raise ValueError(
            f"{str(store.directory)!r} holds no complete checkpoint"
            + (f", only unfinished writes {half} (never read)" if half else "")
            + "; train with fit(..., checkpoint_dir=..., checkpoint_every=N) to make one"
        )
    candidates = [at] if at is not None else list(reversed(steps))
    skipped: list[str] = []
    for number in candidates:
        try:
            meta = store.read(number)[0]
            usable = meta.get("verified") or meta.get("kind") == EMERGENCY
            if at is None and not usable:
                skipped.append(f"step {number} (not verified)")
                continue
            if "state" not in meta.get("items", ("state",)):
                raise _NoState(
                    f"the emergency save {store.directory} holds no state (the devices hung "
                    "and it could not be read): restore the latest verified checkpoint of "
                    "the run instead"
                )
            layout = Layout.from_json(meta["layout"])
            leaves = store.read(number, "state")[1]["state"]
        except _NoState:
            raise
        except Exception as err:
            if at is not None:
                raise ValueError(
                    f"checkpoint {store.directory / str(number)} cannot be read: {err!r}"
                ) from err
            skipped.append(f"step {number} (unreadable: {type(err).__name__})")
            continue
        break
    else:
        raise ValueError(
            f"{str(store.directory)!r} holds no readable verified checkpoint: {skipped}"
        )
    newer = [h for h in half if _tmp_step(h) > number]
    if skipped or newer:
        warnings.warn(
            f"restoring step {number} from {str(store.directory)!r}, passing over "
            + ", ".join(skipped + [f"the unfinished write {h}" for h in newer]),
            stacklevel=4,
        )
    if not usable:
        warnings.warn(f"checkpoint step {number} is not verified", stacklevel=4)
    if meta.get("state_is_good") is False:
        warnings.warn(
            f"{store.directory}: the state of this emergency save is NOT a good one (its "
            "parameters were already non-finite); restore the run's latest verified "
            "checkpoint instead",
            stacklevel=4,
        )
    host = None if isinstance(layout.treedef, Exception) else layout.build(leaves)
    return Loaded(host, leaves, layout, meta, str(store.directory / str(number)))


class _NoState(ValueError):
    pass


def _tmp_step(name: str) -> int:
    head = name.split(_TMP)[0]
    return int(head) if head.isdigit() else -1


def conform(step: TrainStep, loaded: Loaded, template: TrainState | None = None) -> TrainState:
    """The loaded host state, checked against (and shaped like) this run's state.

    ``template`` (a state of this step, e.g. from ``step.init``) is what the state must
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
        want = Layout.of(template, stacked=step.stacked)
        have = dict(zip(saved.names, zip(saved.shapes, saved.dtypes, strict=True), strict=True))
        differ = []
        fresh: list[Any] | None = None
        out: list[Any] = []
        for i, name in enumerate(want.names):
            spec = (want.shapes[i], want.dtypes[i])
            if name not in have and _of_drop(name):  # saved by a run without on_failure="drop"
                if fresh is None:
                    fresh = jax.device_get(local_copy(template, stacked=step.stacked))
                out.append(fresh[i])
                continue
            if name not in have:
                differ.append(f"{name} (not in the checkpoint)")
                continue
            if have[name] != spec and name.startswith(".monitor"):
                if fresh is None:  # per-device windows: they restart on a new device count
                    fresh = jax.device_get(local_copy(template, stacked=step.stacked))
                    warnings.warn(
                        f"the checkpoint's monitor windows are for another device count; "
                        f"they restart here ({len(step.devices)} devices)",
                        stacklevel=3,
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
            warnings.warn(
                "the checkpoint's monitor windows are for another device count; they "
                f"restart here ({n} devices)",
                stacklevel=3,
            )
            host = dataclasses.replace(
                host, monitor={**host.monitor, "spike": jax.device_get(spike.init(n))}
            )
    return _drop_fields(step, host)


def _of_drop(name: str) -> bool:
    """A saved leaf of ``on_failure="drop"``'s memory: a run under another policy has
    none, so a checkpoint may lack it (it starts at zero) or hold it (it is let go)."""
    return name == ".total_drops" or name.startswith((".monitor['drops']", ".monitor['repairs']"))


def _drop_fields(step: TrainStep, host: TrainState) -> TrainState:
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


def restore(
    step: TrainStep, checkpoint_dir: str | os.PathLike[str], *, at: int | None = None
) -> TrainState:
    """Restores the latest verified checkpoint (or step ``at``) onto ``step``'s devices.

    Any device count and either backend: a checkpoint holds one replica of the state.

    Args:
      step: the :class:`jaxstep.TrainStep` to run the state with.
      checkpoint_dir: what ``fit(..., checkpoint_dir=...)`` wrote, or an emergency save
        (``error.checkpoint``).
      at: the step of the checkpoint to restore (default: the latest verified one).

    Returns:
      A :class:`jaxstep.TrainState` placed on ``step``'s devices.

    Raises:
      FileNotFoundError, NotADirectoryError, OSError: the directory is missing or
        unreadable.
      ValueError: it holds no checkpoint, no step ``at``, or another model's state
        (the message names the leaves that differ).

    Example:
      >>> import jax.numpy as jnp, optax, jaxstep, tempfile
      >>> step = jaxstep.make_train_step(
      ...     lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), optax.sgd(0.1),
      ...     divergence_every=2)
      >>> batches = [{"x": jnp.ones(16), "y": 2 * jnp.ones(16)}] * 4
      >>> where = tempfile.mkdtemp()
      >>> state = jaxstep.fit(step, step.init({"w": jnp.zeros(())}), batches,
      ...                     checkpoint_dir=where, checkpoint_every=2)
      >>> int(jaxstep.restore(step, where).step)
      2
    """
    loaded = load(checkpoint_dir, at=at)
    coordination.agree_on_restore(checkpoint_dir, loaded.meta.get("step"), step.devices)
    return step.place_state(conform(step, loaded))

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
every process restores it; see :mod:`jaxstep._src.checkpoint._coordination`. ``checkpoint_dir`` must
then be storage every process sees (a bucket, a shared file system). What is read back
is made to fit the run's step in :mod:`jaxstep._src.checkpoint._loaded`.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxstep._src.checkpoint import _blocks as blocks
from jaxstep._src.checkpoint import _coordination as coordination
from jaxstep._src.checkpoint._layout import Layout
from jaxstep._src.checkpoint._loaded import Loaded
from jaxstep._src.checkpoint._loaded import conform
from jaxstep._src.core import TrainState
from jaxstep._src.core import warn
from jaxstep._src.step import Runtime
from jaxstep._src.step import TrainStep
from jaxstep._src.step import runtime_of

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


def run_meta(
    number: int, devices: Sequence[jax.Device], backend: str, *, verified: bool
) -> dict[str, Any]:
    """What a checkpoint of step ``number`` says of the run that wrote it."""
    return {
        "format": FORMAT,
        "step": number,
        "verified": verified,
        "devices": len(devices),
        "device_ids": [int(d.id) for d in devices],
        "backend": backend,
        "platform": devices[0].platform,
        "process_count": jax.process_count(),
        "host": socket.gethostname(),
        "jaxstep_version": _version(),
        "time": time.time(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version

    try:
        return version("jaxstep")
    except PackageNotFoundError:
        return "unknown"


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
            if "blocks" in meta:  # sharded across processes: each wrote its shards
                leaves = blocks.assemble(store.directory, number, meta, leaves)
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
        warn(
            f"restoring step {number} from {str(store.directory)!r}, passing over "
            + ", ".join(skipped + [f"the unfinished write {h}" for h in newer]),
        )
    if not usable:
        warn(f"checkpoint step {number} is not verified")
    if meta.get("state_is_good") is False:
        warn(
            f"{store.directory}: the state of this emergency save is NOT a good one (its "
            "parameters were already non-finite); restore the run's latest verified "
            "checkpoint instead",
        )
    host = None if isinstance(layout.treedef, Exception) else layout.build(leaves)
    return Loaded(host, leaves, layout, meta, str(store.directory / str(number)))


class _NoState(ValueError):
    pass


def _tmp_step(name: str) -> int:
    head = name.split(_TMP)[0]
    return int(head) if head.isdigit() else -1


def restore(
    step: TrainStep, checkpoint_dir: str | os.PathLike[str], *, at: int | None = None
) -> TrainState:
    """Restores the latest verified checkpoint (or step ``at``) onto ``step``'s devices.

    Any device count, either backend and any ``shard_state``: a checkpoint holds one
    copy of every leaf, whole, whatever the layout that wrote it, and the state comes
    back laid out as ``step`` lays it out (sharded by its rule, or replicated).

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
      >>> int(jaxstep.restore(step, where).step)  # the run's end, saved by fit
      4
      >>> int(jaxstep.restore(step, where, at=2).step)
      2
    """
    return restore_on(runtime_of(step), checkpoint_dir, at=at)


def restore_on(
    runtime: Runtime, checkpoint_dir: str | os.PathLike[str], *, at: int | None = None
) -> TrainState:
    """:func:`restore` onto a step's runtime (fit's rollback: the runtime it runs on)."""
    loaded = load(checkpoint_dir, at=at)
    coordination.agree_on_restore(checkpoint_dir, loaded.meta.get("step"), runtime.devices)
    return runtime.place_state(conform(runtime, loaded))

"""What the processes of a multi-process run tell each other about checkpoints.

A jaxstep state is replicated: every process holds the same verified copy, so one
process (process 0, the *writer*) writes each checkpoint: the one replica orbax would
write of a replicated array anyway. What differs between
processes is the data position (each process reads its own rows), so every process
publishes its position for each checkpoint step, and the writer (process 0) stores
them all; on
resume every process reads the checkpoint and takes its own position back.

All of it goes through the coordination service's key-value store, never through a
collective or an orbax barrier: a lost peer can only make a read time out, and so a
process whose peer died still writes its emergency save and raises. Each key is deleted
once read by every process that reads it (:func:`jaxstep._src.core.processes.release`, or
the writer's :func:`forget` of the positions it gathered), and the writer clears a fit
call's positions at its end (:func:`forget_run`): a long run does not grow the store.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src.core.processes import KEY
from jaxstep._src.core.processes import client as _client
from jaxstep._src.core.processes import release

_KEY = f"{KEY}ckpt/"
_runs = itertools.count()


def processes(devices: Sequence[jax.Device]) -> list[int]:
    """The process indices of ``devices``, sorted; one entry outside a multi-process run."""
    return sorted({int(d.process_index) for d in devices})


def is_writer() -> bool:
    """True on the process that writes the checkpoints: process 0 (orbax writes host
    arrays from process 0 only)."""
    return jax.process_index() == 0


def new_run() -> str:
    """A key prefix for one ``fit`` call. Every process calls ``fit`` the same number of
    times in the same order (the steps are collectives), so the counters agree."""
    return f"{_KEY}{next(_runs)}/"


class Positions:
    """One fit call's data positions on several processes (``among``): each process
    publishes its own for a checkpoint step before it dispatches that step, and the
    writer gathers them when it writes the checkpoint. Every key is deleted once the
    writer no longer needs it: gathered, or never to be (the replicas disagreed, a
    recovery let the step go: swept when the fit call ends). Also the newest verified
    step, which only the writer knows (:meth:`latest`)."""

    def __init__(self, among: Sequence[int]):
        self.among = list(among)
        self.prefix = new_run()
        # the checkpoint steps published whose tables are not read yet (with
        # checkpoint_every=1 the next is published before the table of one is read)
        self.published: set[int] = set()
        self.asked = 0  # latest calls, the same count on every process

    def publish(self, number: int, position: Any) -> None:
        """This process's position (JSON) for the checkpoint of step ``number``."""
        publish(f"{self.prefix}pos/{number}", position)
        self.published.add(number)

    def gather(self, number: int, timeout_s: float) -> dict[int, Any]:
        """Every process's position for step ``number`` (the writer), then deleted.

        Raises:
          TimeoutError: a process published nothing within ``timeout_s`` (lost).
        """
        key = f"{self.prefix}pos/{number}"
        found = gather(key, self.among, timeout_s)
        forget(key, self.among)
        return found

    def settled(self, number: int, verified: bool) -> bool:
        """Step ``number``'s table was read (every process reads the same): whether the
        checkpoint whose position this process published for it is written (its replicas
        agreed). The writer deletes the positions of one that is not."""
        if number not in self.published:
            return False
        self.published.discard(number)
        if not verified and is_writer():
            forget(f"{self.prefix}pos/{number}", self.among)
        return verified

    def latest(self, answer: Callable[[], Any], timeout_s: float) -> Any:
        """``answer()`` (the newest verified step) as the writer finds it, on every
        process (:func:`from_writer`)."""
        self.asked += 1
        return from_writer(f"{self.prefix}latest/{self.asked}", answer, self.among, timeout_s)

    def close(self) -> None:
        """The fit call ends (its writes done): the writer deletes the positions no write
        gathered (the other processes publish before each step, so all are in)."""
        if is_writer():
            with contextlib.suppress(Exception):
                _client().key_value_delete(f"{self.prefix}pos")


def publish(key: str, value: Any) -> None:
    """Sets ``key``/<this process> to ``value`` (JSON)."""
    _client().key_value_set(f"{key}/{jax.process_index()}", json.dumps(value), True)


def gather(key: str, among: Iterable[int], timeout_s: float) -> dict[int, Any]:
    """What each process in ``among`` published under ``key``.

    Raises:
      TimeoutError: a process published nothing within ``timeout_s`` (lost, or behind).
    """
    client, out = _client(), {}
    for p in among:
        try:
            out[p] = json.loads(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
        except Exception as err:  # the runtime raises its own error type on a timeout
            raise TimeoutError(
                f"process {p} did not publish {key!r} within {timeout_s:g} s ({err})"
            ) from None
    return out


def from_writer(key: str, answer: Callable[[], Any], among: Sequence[int], timeout_s: float) -> Any:
    """``answer()`` as the writer finds it, on every process of ``among``: the writer
    calls it and publishes it under ``key``, the others wait for it (the last of them
    to read it deletes it). For what only the writer knows: which of its writes
    finished (the others' orbax managers list the steps they saw when they were opened).

    Raises:
      TimeoutError: the writer published nothing within ``timeout_s`` (lost).
    """
    if is_writer():
        value = answer()
        publish(key, value)
        return value
    value = gather(key, [0], timeout_s)[0]
    release(key, len(among) - 1)
    return value


def forget(key: str, among: Iterable[int]) -> None:
    """Deletes what :func:`publish` set under ``key`` (best effort)."""
    client = _client()
    for p in among:
        with contextlib.suppress(Exception):
            client.key_value_delete(f"{key}/{p}")


def agree_on_restore(
    directory: str | os.PathLike[str],
    step: int | None,
    devices: Sequence[jax.Device],
    timeout_s: float = 60.0,
) -> None:
    """Checks that every process is about to restore the same checkpoint step.

    Every process reads the checkpoint itself; if ``checkpoint_dir`` is a disk that
    only one host sees, or a write landed between two reads, they would resume from
    different states and the first step would fail as diverged. Say why now instead.

    Raises:
      ValueError: the processes found different checkpoints.
    """
    among = processes(devices)
    if len(among) < 2:
        return
    key = f"{_KEY}restore/{next(_runs)}"
    publish(key, step)
    seen = gather(key, among, timeout_s)
    release(key, len(among))
    if len(set(seen.values())) > 1:
        found = ", ".join(f"process {p}: {s if s is not None else 'none'}" for p, s in seen.items())
        raise ValueError(
            f"the processes found different checkpoints to restore in {str(directory)!r} "
            f"({found}): checkpoint_dir must be one storage every process sees (a bucket "
            "or a shared file system), not a local disk per host"
        )

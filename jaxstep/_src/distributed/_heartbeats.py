"""Heartbeats between the processes of a run, through the key-value store of the
``jax.distributed`` coordination service: each process sets its own key every
interval and reads everyone's in one call; a key that stops moving names a lost
process. Used by :mod:`jaxstep.distributed`."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src.core import log
from jaxstep._src.core.processes import KEY
from jaxstep._src.core.processes import client
from jaxstep._src.core.processes import release

_NEVER_BEAT = 3  # a process that never beat gets this many timeouts to start


class PeerHeartbeats:
    """Whether each peer process is alive: heartbeats through the coordination
    service's key-value store (started by :func:`jaxstep.distributed.watch`). Not to be
    confused with the step watchdog of ``fit(step_timeout=...)``, which watches one
    step on this process's devices.

    A daemon thread sets ``jaxstep/alive/{me}`` to a counter every ``timeout / 10``
    seconds (at most every second) and reads every process's counter in one call. A
    process whose counter has not moved for ``timeout`` seconds (by this process's own
    clock: no clock skew) is lost; if the store itself stops answering for ``timeout``
    seconds, process 0, which hosts it, is lost. A process that finished sets its key to
    ``done``.

    Args:
      client: the coordination service's client (``jax.distributed``'s).
      me: this process's index.
      count: the number of processes in the run.
      timeout: seconds without a beat before a process is lost.

    Example:
      With a stand-in for the coordination service's client (``jax.distributed``'s, in a
      run), unstarted:

      >>> from jaxstep.distributed import PeerHeartbeats
      >>> class Store:
      ...     def key_value_set(self, key, value, allow_overwrite=False):
      ...         print(key, "=", value)
      >>> beats = PeerHeartbeats(Store(), me=0, count=2, timeout=10.0)
      >>> beats.interval, beats.lost()
      (1.0, {})
      >>> beats.stop()  # finished: the others do not wait for it
      jaxstep/alive/0 = done
    """

    def __init__(self, client: Any, me: int, count: int, timeout: float):
        self.client = client
        self.me = me
        self.count = count
        self.timeout = timeout
        self.interval = min(1.0, timeout / 10)
        now = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {p: ("", now) for p in range(count)}
        self._store_ok = now
        self._lost: dict[int, str] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="jaxstep-heartbeat", daemon=True)

    def start(self) -> None:
        """Starts the beating thread (:func:`jaxstep.distributed.watch` does)."""
        self._thread.start()

    def stop(self) -> None:
        """Tells the others this process is done (not lost) and stops beating."""
        self.mark("done")

    def mark(self, value: str) -> None:
        """Stops beating and leaves ``value`` for the others.

        Args:
          value: ``done`` (finished, not lost), ``failed: why`` or ``exited`` (lost at
            once, no timeout to wait).
        """
        self._done.set()
        with contextlib.suppress(Exception):  # the store may be gone already
            self.client.key_value_set(f"{KEY}alive/{self.me}", value, allow_overwrite=True)

    def wait_for_others(self, wait_s: float) -> None:
        """Waits until every other process has left (``exited``/``done``) or is lost.

        Args:
          wait_s: the most seconds to wait.
        """
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                values = dict(self.client.key_value_dir_get(f"{KEY}alive/"))
            except Exception:
                return
            left = {p for p in range(self.count) if p != self.me} - set(self.lost())
            gone = ("exited", "done", "failed: ")
            if all(values.get(f"{KEY}alive/{p}", "").startswith(gone) for p in left):
                return
            time.sleep(0.1)

    def lost(self) -> dict[int, str]:
        """The processes declared lost so far.

        Returns:
          ``{process index: why}``; empty while every process beats.
        """
        with self._lock:
            return dict(self._lost)

    def _run(self) -> None:
        beat = 0
        while not self._done.is_set():
            beat += 1
            self._tick(beat)
            self._done.wait(self.interval)

    def _tick(self, beat: int) -> None:
        now = time.monotonic()
        try:
            self.client.key_value_set(f"{KEY}alive/{self.me}", str(beat), allow_overwrite=True)
            values = dict(self.client.key_value_dir_get(f"{KEY}alive/"))
        except Exception as err:  # the store lives in process 0
            if self.me != 0 and now - self._store_ok > self.timeout:
                self._declare(0, f"its coordination service stopped answering ({err})")
            return
        self._store_ok = now
        for p in range(self.count):
            value = values.get(f"{KEY}alive/{p}", "")
            last, since = self._seen[p]
            if p == self.me or value == "done":
                continue
            if value.startswith("failed: ") or value == "exited":
                self._declare(p, f"it {value}")  # it said so: no timeout to wait for
            elif value != last:
                self._seen[p] = (value, now)
            elif not value and now - since > _NEVER_BEAT * self.timeout:
                # Not started yet (its script reached fit later) or dead before it did.
                self._declare(p, f"it never sent a heartbeat in {_NEVER_BEAT * self.timeout:g} s")
            elif value and now - since > self.timeout:
                self._declare(
                    p,
                    f"it stopped sending heartbeats for {self.timeout:g} s "
                    "(killed, crashed or frozen)",
                )

    def _declare(self, process: int, why: str) -> None:
        with self._lock:
            if process not in self._lost:
                log.error("jaxstep: process %d is lost: %s", process, why)
                self._lost[process] = why


def share_heartbeats(step: int, local: Sequence[int], wait_s: float) -> tuple[set[int], list[int]]:
    """After a step timed out: publishes which of this process's device positions
    finished their local part of ``step``, and reads the others'.

    Args:
      step: the step that timed out.
      local: the positions (in the step's device order) of this process's devices that
        finished their part of it.
      wait_s: the most seconds to wait for the other processes' reports.

    Returns:
      (every position that finished, on any process; processes that did not report
      within ``wait_s`` seconds).

    Example:
      >>> from jaxstep.distributed import share_heartbeats
      >>> share_heartbeats(5, [0, 1, 2], wait_s=1.0)  # one process: its own alone
      ({0, 1, 2}, [])
    """
    store = client()
    me = jax.process_index()
    done = set(local)
    if store is None:
        return done, []
    key = f"{KEY}beats/{step}"
    store.key_value_set(f"{key}/{me}", json.dumps(sorted(local)), True)
    silent = []
    deadline = time.monotonic() + wait_s
    for p in range(jax.process_count()):
        if p == me:
            continue
        left = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            done |= set(json.loads(store.blocking_key_value_get(f"{key}/{p}", left)))
        except Exception:
            silent.append(p)
    # deleted once every process read them (a silent one never does: the run is ending)
    release(key, jax.process_count())
    return done, silent

"""What fit writes into the :class:`~jaxstep.History` for each step it settles: the
raw table, the scalars of its ``aux``, its examples per second, the time the loop
waited for its batch, and, once a device left the run, the columns its devices fill."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.core import COL
from jaxstep._src.core import log
from jaxstep._src.loop._history import History
from jaxstep._src.loop._pending import Pending
from jaxstep._src.loop._records import Recovery


class Recorder:
    """Writes each step one fit call settles into ``history`` (one ``append`` of the
    raw table and three numbers: no decoding, no allocation beyond the block's)."""

    __slots__ = ("_aux", "columns", "devices", "history", "ledger", "since")

    def __init__(self, history: History):
        self.history = history
        self.ledger = history.ledger  # where the step's time goes
        self.devices = 0  # devices of the step
        self.columns: Any = None  # their positions in history.device_ids (None: all, in order)
        self.since = 0.0  # when the step before was settled (or the run started)
        self._aux: tuple[Any, list[tuple[int, str]]] | None = None  # see scalar_aux

    def start(self, ids: list[int], origin: list[int] | None) -> None:
        """The run starts on the devices ``ids``; ``origin``: the devices its step was
        built with, when some left in an earlier fit call (the history keeps a column
        for each)."""
        history = self.history
        if not (history.device_ids and set(ids) < set(history.device_ids)):
            # (a history shared with the fit calls before keeps its columns)
            history.device_ids = ids if origin is None else origin
        self.now_on(ids)

    def now_on(self, ids: Sequence[int]) -> None:
        """The step runs on the devices ``ids`` from now on."""
        self.devices = len(ids)
        if self.history.device_ids != list(ids):
            where = {d: i for i, d in enumerate(self.history.device_ids)}
            self.columns = np.asarray([where[d] for d in ids])

    def recovery(self, record: Recovery, *, shown: bool) -> None:
        """A recovery ``fit(recover=...)`` made (or a repair the step made itself),
        recorded and logged (at INFO when a callback ``shown`` it, else WARNING)."""
        self.history.recoveries.append(record)
        log.log(
            logging.INFO if shown else logging.WARNING, "jaxstep recovered a failure: %s", record
        )

    def left_over(self, spans: Sequence[tuple[int, int, int]]) -> None:
        """Rows never trained (a carry let them go), listed."""
        if spans:
            self.history.left_over.extend(spans)

    def settled(self, pending: Pending, raw: np.ndarray) -> None:
        """A step settled (``raw``: its table as read): recorded with the examples per
        second since the one before."""
        now = time.perf_counter()
        aux = pending.out.aux
        metrics = None if aux is None else self.scalar_aux(aux)
        rate = self.devices * pending.rows / max(now - self.since, 1e-9)
        history, ledger = self.history, self.ledger
        history.append(raw, metrics, rate, pending.rows, self.columns, pending.wait)
        self.since = now
        data = ledger.data
        seconds = ledger.step(len(history) - 1, now)
        if ledger.record is not None:  # beside the checkpoints: carried across a restart
            ledger.record.put(step_line(pending.number, seconds, data, raw))

    def add(self, pending: Pending, raw: np.ndarray) -> None:
        """``pending``'s step (read, not settled: its rate unknown), recorded."""
        aux = pending.out.aux
        metrics = None if aux is None else self.scalar_aux(aux)
        self.history.append(raw, metrics, math.nan, pending.rows, self.columns, pending.wait)

    def scalar_aux(self, aux: Any) -> dict[str, float]:
        """The mean over devices of each scalar entry of a step's ``aux`` (one value per
        device, leading axis ``devices``), named by its keys joined with ``/``. Which
        leaves those are is found once per structure (no walk of the paths at each
        step). Called once the step has finished: reading them does not wait."""
        leaves, treedef = jax.tree.flatten(aux)
        if self._aux is None or self._aux[0] != (treedef, self.devices):
            self._aux = ((treedef, self.devices), _scalars(aux, self.devices))
        return {name: float(np.mean(np.asarray(leaves[i], np.float64))) for i, name in self._aux[1]}


def step_line(number: int, seconds: float, data: float, raw: np.ndarray) -> dict[str, Any]:
    """A settled step's line of the record beside the checkpoints: its number, time,
    outcome (its update kept, skipped or failed), dropped chunks and data wait."""
    outcome = "ok"
    if raw.item(0, COL["failed"]) and raw.item(0, COL["halted"]):
        outcome = "failed"
    elif raw.item(0, COL["skipped"]):
        outcome = "skipped"
    dropped = int(np.count_nonzero(raw[:, COL["dropped"]]))
    return {"n": number, "s": seconds, "o": outcome, "d": dropped, "w": data}


def _scalars(aux: Any, n: int) -> list[tuple[int, str]]:
    """The leaves of ``aux`` that hold one number per device: (index, name)."""
    found = []
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(aux)):
        if getattr(x, "shape", None) == (n,) and jnp.issubdtype(x.dtype, jnp.number):
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            found.append((i, name or "aux"))
    return found

"""What a process does when it fails in a run of several: its JSON error report (one
report marked as the root cause across every host), the :func:`record` decorator for a
script's ``main``, and leaving without waiting on peers that cannot finish."""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import NoReturn
from typing import TypeVar

import jax

from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import log
from jaxstep._src.core.processes import KEY
from jaxstep._src.core.processes import client as _client
from jaxstep._src.core.processes import host_name
from jaxstep._src.distributed import reports
from jaxstep._src.distributed._runtime import is_multiprocess
from jaxstep._src.distributed._runtime import lost_processes
from jaxstep._src.distributed._runtime import monitor

_F = TypeVar("_F", bound=Callable[..., Any])


def _origin(exc: BaseException) -> int | None:
    """The process where ``exc`` started: the failing device's, a lost process, or
    this one."""
    failures = getattr(exc, "failures", None)
    if failures:
        return int(failures[0].process_index)
    return jax.process_index()


def write_error_report(
    exc: BaseException, directory: str | os.PathLike[str] | None = None
) -> Path | None:
    """Writes this process's JSON report of ``exc`` (:mod:`jaxstep.distributed.reports`).

    Marks it the root cause when the failure started here (the failing device is
    local, or the exception is not a verdict about another process) and no other
    process claimed the root cause before: the first claim in the coordination
    service's store wins, so exactly one report is marked even across hosts.

    Args:
      exc: the exception this process is about to die of.
      directory: where (default ``$JAXSTEP_ERROR_DIR``; None and unset: nothing).

    Returns:
      The report's path, or None when no directory is set.

    Example:
      >>> import tempfile
      >>> from jaxstep.distributed import reports, write_error_report
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     path = write_error_report(ValueError("bad batch"), errors)
      ...     report = reports.read(errors)[0]
      >>> path.name, report["exception"], report["message"], report["root_cause"]
      ('error-p0.json', 'ValueError', 'bad batch', True)
    """
    where = reports.error_dir(directory)
    if where is None:
        return None
    me = jax.process_index() if _client() is not None else 0
    origin = _origin(exc)
    own = origin == me
    root = own
    client = _client()
    if own and client is not None and is_multiprocess():
        try:
            client.key_value_set(f"{KEY}root_cause", str(me), allow_overwrite=False)
        except Exception as err:  # ALREADY_EXISTS: someone failed first; else no store
            if "ALREADY_EXISTS" in str(err) or "already exists" in str(err):
                root = False
    report = reports.build(
        exc, process_index=me, root_cause=root, root_cause_process=origin, host=host_name(me)
    )
    return reports.write(report, where)


def record(fn: _F) -> _F:
    """Decorator for a training script's ``main`` (torchrun's ``@record``): an exception
    is written as this process's error report (:func:`write_error_report`, to
    ``$JAXSTEP_ERROR_DIR``).

    A verdict every process reached (the same ``TrainingWorkerError``) is re-raised as
    usual. Any other failure leaves the others unable to finish their step: this process
    tells them at once (they raise a lost-process error naming it at their next
    heartbeat, not after the timeout), and, since the computation in flight can neither
    finish nor be cancelled and JAX's exit would wait for the peers, it leaves with
    ``os._exit(1)``, its output flushed (process 0, which hosts the coordination
    service, waits up to 10 s for the others to leave first).

    Args:
      fn: the function to watch.

    Returns:
      ``fn`` wrapped: it returns what ``fn`` returns, and re-raises what it raises
      (but for the exit above).

    Example:
      >>> import os, tempfile
      >>> from unittest import mock
      >>> from jaxstep.distributed import record, reports
      >>> @record
      ... def main(steps):
      ...     if steps < 0:
      ...         raise ValueError(f"steps must be >= 0, got {steps}")
      ...     return steps
      >>> main(3)
      3
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     with mock.patch.dict(os.environ, {reports.ENV_ERROR_DIR: errors}):
      ...         try:
      ...             main(-1)
      ...         except ValueError:
      ...             pass  # re-raised (one process), its report written first
      ...     print(reports.root_cause(errors)["message"])
      steps must be >= 0, got -1
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                raise
            path = write_error_report(exc)
            if path is not None:
                log.error("jaxstep: error report written to %s", path)
            peers = monitor()
            if not is_multiprocess() or peers is None:
                raise
            if _shared_verdict(exc):
                peers.stop()
                raise
            traceback.print_exception(exc)
            if isinstance(exc, TrainingWorkerError):  # a hang or a lost peer: all leave
                leave(exit_code=1, note="exited")
            first = (str(exc).splitlines() or [""])[0][:200]
            leave(exit_code=1, note=f"failed: {type(exc).__name__}: {first}")
            raise  # not reached
        peers = monitor()
        if peers is not None:
            peers.stop()
        return result

    return wrapper  # type: ignore[return-value]


def _shared_verdict(exc: BaseException) -> bool:
    """Whether every process raised this same error (a verdict from the health table)."""
    if not isinstance(exc, TrainingWorkerError) or lost_processes():
        return False
    return not any(f.status & Status.HUNG for f in exc.failures)


def leave(exit_code: int, note: str = "exited", wait_s: float = 10.0) -> NoReturn:
    """Tells the other processes, and exits with ``os._exit(exit_code)``, its output
    and logs flushed: after a hang or a lost peer the computation in flight can neither
    finish nor be cancelled, and JAX's exit would wait for the peers. Process 0 first
    waits for the others to leave, since they abort when its coordination service goes
    before them. One process: flushes and exits.

    Args:
      exit_code: the process's exit code.
      note: what the others read: ``exited`` or ``failed: why`` (they declare this
        process lost at once), or ``done``.
      wait_s: the most seconds process 0 waits for the others.

    Example:
      It ends the process (``os._exit``): after a hang, in place of ``raise``::

          except jaxstep.TrainingWorkerError as err:
              if err.status & jaxstep.Status.HUNG:
                  jaxstep.distributed.leave(jaxstep.RESTART_EXIT_CODE)
              raise
    """
    peers = monitor()
    if peers is not None:
        peers.mark(note)
        if peers.me == 0:
            peers.wait_for_others(wait_s)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(exit_code)

"""Many processes, one run: ``jax.distributed`` set-up, which process feeds which rows,
host names, error reports, and the peer heartbeats that name a lost process.

Every process runs the same program; a step's devices span all of them, and each
process passes only the rows of the chunks whose devices it holds, in the step's
device order (:func:`local_rows`, from :mod:`jaxstep.core.processes`). The health table is
global, so every process reaches the same verdict inside the step and raises the same
error. Processes meet in the coordination service of ``jax.distributed`` (on
process 0), whose key-value store carries host names, heartbeats and the root-cause
claim.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import NoReturn
from typing import TypeVar

import jax

from jaxstep.core import Failure
from jaxstep.core import Status
from jaxstep.core import TrainingWorkerError
from jaxstep.core.processes import KEY
from jaxstep.core.processes import client as _client
from jaxstep.core.processes import host_name as host_name
from jaxstep.core.processes import local_batch as local_batch
from jaxstep.core.processes import local_positions as local_positions
from jaxstep.core.processes import local_rows as local_rows
from jaxstep.core.processes import local_rows_per_device as local_rows_per_device
from jaxstep.core.processes import place_local_batch as place_local_batch
from jaxstep.core.processes import process_pid as process_pid
from jaxstep.core.processes import spans_processes as spans_processes
from jaxstep.distributed import reports
from jaxstep.distributed._heartbeats import PeerHeartbeats

log = logging.getLogger("jaxstep")

ENV_COORDINATOR = "JAXSTEP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXSTEP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSTEP_PROCESS_ID"
ENV_LOST_TIMEOUT = "JAXSTEP_LOST_TIMEOUT"

#: Seconds without a heartbeat after which a process counts as lost. Below XLA's
#: ~40 s abort of a CPU collective with a missing peer, and below the coordination
#: service's own heartbeat timeout (100 s), which kills every process without a word.
DEFAULT_LOST_TIMEOUT = 10.0
_KEY = KEY
_F = TypeVar("_F", bound=Callable[..., Any])


def is_multiprocess() -> bool:
    """True when this run spans more than one process."""
    return jax.process_count() > 1


def initialize(
    *,
    lost_timeout: float | None = None,
    heartbeat_timeout_seconds: int = 100,
    **kwargs: Any,
) -> None:
    """Joins (or starts) the multi-process run, then starts the peer heartbeats
    (:func:`watch`) that name a lost process.

    Under ``python -m jaxstep.launch`` the coordinator, process count and id come from
    ``$JAXSTEP_COORDINATOR``, ``$JAXSTEP_NUM_PROCESSES`` and ``$JAXSTEP_PROCESS_ID``;
    otherwise ``jax.distributed.initialize(**kwargs)`` finds them itself (TPU VMs,
    SLURM, Open MPI) or takes them from ``kwargs``. Call it first, before any JAX
    computation. Each process publishes its host name and pid, so errors can name
    the host of a failing device.

    Args:
      lost_timeout: seconds without a heartbeat from a process before the others
        declare it lost (default ``$JAXSTEP_LOST_TIMEOUT`` or 10 s). Must be below
        ``heartbeat_timeout_seconds``.
      heartbeat_timeout_seconds: the coordination service's own limit; past it, JAX
        terminates every process (with no error report), so jaxstep must act first.
      **kwargs: passed to ``jax.distributed.initialize``.

    Raises:
      ValueError: ``lost_timeout`` is not below ``heartbeat_timeout_seconds``, or the
        environment variables are malformed.
    """
    timeout = _lost_timeout(lost_timeout)
    if not timeout < heartbeat_timeout_seconds:
        raise ValueError(
            f"lost_timeout={timeout:g} s must be below heartbeat_timeout_seconds="
            f"{heartbeat_timeout_seconds}: past that, JAX terminates every process before "
            "jaxstep can name the lost one"
        )
    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator is not None and "coordinator_address" not in kwargs:
        try:
            kwargs.update(
                coordinator_address=coordinator,
                num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                process_id=int(os.environ[ENV_PROCESS_ID]),
            )
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"${ENV_COORDINATOR} is set but ${ENV_NUM_PROCESSES} / ${ENV_PROCESS_ID} are "
                f"missing or not integers ({err}); start the processes with python -m "
                "jaxstep.launch, or unset it"
            ) from None
    if _client() is None:
        try:
            jax.distributed.initialize(
                heartbeat_timeout_seconds=heartbeat_timeout_seconds, **kwargs
            )
        except ValueError as err:
            if "coordinator_address" not in str(err) or kwargs:
                raise
            raise ValueError(
                "no multi-process environment found (TPU VM slice, SLURM, Open MPI, or "
                f"${ENV_COORDINATOR} from python -m jaxstep.launch): pass "
                "coordinator_address, num_processes and process_id, or on one machine run "
                "without initialize (one process), or try N processes with python -m "
                "jaxstep.launch -n N script.py"
            ) from err
    watch(timeout)


def watch(lost_timeout: float | None = None) -> PeerHeartbeats | None:
    """Starts this process's peer heartbeats (once) and publishes its host name and pid.

    Liveness comes in two kinds in jaxstep. *Peer heartbeats* (this function) watch
    whole processes: a thread beats through the coordination service's store, and a
    peer whose beat stops for ``lost_timeout`` seconds is declared lost, so ``fit``
    raises a ``HUNG`` error naming its devices instead of waiting in a collective
    that cannot finish. The *step watchdog* of ``fit(step_timeout=...)`` watches one
    step on this process's devices; it is unrelated to this function.

    :func:`initialize` calls it; :func:`jaxstep.fit` calls it too when
    ``jax.distributed.initialize`` was called directly.

    Args:
      lost_timeout: seconds without a heartbeat before a peer is lost (default
        ``$JAXSTEP_LOST_TIMEOUT`` or 10 s); ignored once the heartbeats run.

    Returns:
      The running heartbeats (as :func:`monitor` returns them), or None when this is
      not a multi-process run.
    """
    global _peers
    client = _client()
    if client is None or _peers is not None:
        return _peers
    me = jax.process_index()
    client.key_value_set(
        f"{_KEY}host/{me}",
        json.dumps({"host": socket.gethostname(), "pid": os.getpid()}),
        allow_overwrite=True,
    )
    _peers = PeerHeartbeats(client, me, jax.process_count(), _lost_timeout(lost_timeout))
    _peers.start()
    return _peers


def _lost_timeout(value: float | None) -> float:
    if value is None:
        value = float(os.environ.get(ENV_LOST_TIMEOUT, DEFAULT_LOST_TIMEOUT))
    if not value > 0:
        raise ValueError(f"lost_timeout must be > 0 seconds, got {value!r}")
    return float(value)


# ---------------------------------------------- lost processes (peer heartbeats)
_peers: PeerHeartbeats | None = None


def monitor() -> PeerHeartbeats | None:
    """This process's peer heartbeats, as :func:`watch` started them: their
    ``lost()`` names the processes declared lost so far, and why. None before
    :func:`watch` (or :func:`initialize`) ran, and outside a multi-process run.

    Only whole processes are watched here; a hung step on this process's own
    devices is the step watchdog's (``fit(step_timeout=...)``)."""
    return _peers


def lost_processes() -> dict[int, str]:
    """Processes declared lost so far, and why."""
    return {} if _peers is None else _peers.lost()


def wait_ready(array: jax.Array, step: int, devices: Sequence[jax.Device]) -> None:
    """Returns once ``array`` (a step's output) is ready. While it is not, watches for
    lost processes, and raises their error instead of waiting for a peer that will
    never come (single process: returns at once; the caller's read waits).

    Raises:
      TrainingWorkerError: a process of the run is lost (status ``HUNG``, naming its
        devices), after the Python stacks went to the ``jaxstep`` logger.
    """
    if _peers is None:
        return
    pause = 1e-4
    while not array.is_ready():  # type: ignore[attr-defined]
        lost = _peers.lost()
        if lost:
            raise lost_error(lost, step, devices)
        time.sleep(pause)
        pause = min(pause * 2, 0.005)


def finish_in_flight(array: jax.Array, err: BaseException) -> None:
    """Before this process raises ``err`` out of ``fit``: waits (at most the lost
    timeout) for the newest dispatched step, which every live peer has dispatched
    too, so that no process leaves in the middle of a collective (gloo aborts a
    peer that receives half a message). Returns at once when that step cannot
    finish: a peer is lost, or ``err`` is a hang."""
    if _peers is None or (isinstance(err, TrainingWorkerError) and err.status & Status.HUNG):
        return
    deadline = time.monotonic() + _peers.timeout
    while not array.is_ready() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        if _peers.lost():
            return
        time.sleep(0.005)


def lost_after(err: BaseException, step: int, devices: Sequence[jax.Device]) -> BaseException:
    """For a runtime error from a collective: the lost-process error if a peer turns
    out lost within the heartbeats' timeout (a dead peer's socket can fail the
    collective before the heartbeats run out), else ``err`` itself."""
    if _peers is None:
        return err
    deadline = time.monotonic() + _peers.timeout + 2 * _peers.interval
    while time.monotonic() < deadline:
        lost = _peers.lost()
        if lost:
            return lost_error(lost, step, devices)
        time.sleep(0.05)
    return err


def lost_error(
    lost: dict[int, str], step: int, devices: Sequence[jax.Device]
) -> TrainingWorkerError:
    """The ``HUNG`` error naming every device of each lost process (state: None)."""
    names = ", ".join(f"process {p} (host {host_name(p)}, pid {process_pid(p)})" for p in lost)
    log_stacks(f"step {step} cannot finish: lost {names}")
    failures = [
        Failure(
            device_id=d.id,
            process_index=d.process_index,
            step=step,
            status=Status.HUNG,
            reason=f"its process {d.process_index} is lost: {lost[d.process_index]}",
            leaf=None,
            host=host_name(d.process_index),
        )
        for d in devices
        if d.process_index in lost
    ]
    note = (
        f"lost: {names}; devices {[f.device_id for f in failures]}. The state cannot be "
        "read back from a lost process: error.state is None; restart the job from the last "
        "checkpoint"
    )
    return TrainingWorkerError(failures, state=None, note=note)


def log_stacks(why: str) -> None:
    """Every Python thread's stack to the ``jaxstep`` logger (before raising a hang)."""
    stacks = "\n".join(
        f"--- thread {ident}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )
    log.error("%s; Python stacks:\n%s", why, stacks)


# ------------------------------------------------------------------- reports
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
    """Writes this process's JSON report of ``exc`` (see :mod:`jaxstep.distributed.reports`).

    Marks it the root cause when the failure started here (the failing device is
    local, or the exception is not a verdict about another process) and no other
    process claimed the root cause before: the first claim in the coordination
    service's store wins, so exactly one report is marked even across hosts.

    Args:
      exc: the exception this process is about to die of.
      directory: where (default ``$JAXSTEP_ERROR_DIR``; None and unset: nothing).

    Returns:
      The report's path, or None when no directory is set.
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
            client.key_value_set(f"{_KEY}root_cause", str(me), allow_overwrite=False)
        except Exception as err:  # ALREADY_EXISTS: someone failed first; else no store
            if "ALREADY_EXISTS" in str(err) or "already exists" in str(err):
                root = False
    report = reports.build(
        exc, process_index=me, root_cause=root, root_cause_process=origin, host=host_name(me)
    )
    return reports.write(report, where)


def record(fn: _F) -> _F:
    """Decorator for a training script's ``main`` (torchrun's ``@record``): an exception
    is written as this process's error report (``$JAXSTEP_ERROR_DIR``).

    A verdict every process reached (the same ``TrainingWorkerError``) is re-raised as
    usual. Any other failure leaves the others unable to finish their step: this process
    tells them at once (they raise a lost-process error naming it at their next
    heartbeat, not after the timeout), and, since the computation in flight can neither
    finish nor be cancelled and JAX's exit would wait for the peers, it leaves with
    ``os._exit(1)``, its output flushed (process 0, which hosts the coordination
    service, waits up to 10 s for the others to leave first).
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
            if not is_multiprocess() or _peers is None:
                raise
            if _shared_verdict(exc):
                _peers.stop()
                raise
            traceback.print_exception(exc)
            if isinstance(exc, TrainingWorkerError):  # a hang or a lost peer: all leave
                leave(exit_code=1, note="exited")
            first = (str(exc).splitlines() or [""])[0][:200]
            leave(exit_code=1, note=f"failed: {type(exc).__name__}: {first}")
            raise  # not reached
        if _peers is not None:
            _peers.stop()
        return result

    return wrapper  # type: ignore[return-value]


def _shared_verdict(exc: BaseException) -> bool:
    """Whether every process raised this same error (a verdict from the health table)."""
    if not isinstance(exc, TrainingWorkerError) or lost_processes():
        return False
    return not any(f.status & Status.HUNG for f in exc.failures)


def leave(exit_code: int, note: str = "exited", wait_s: float = 10.0) -> NoReturn:
    """Tells the others (``note``: ``exited`` or ``failed: why``, which they read as this
    process lost, at once) and exits with ``os._exit(exit_code)``, its output and logs
    flushed: after a hang or a lost peer the computation in flight can neither finish
    nor be cancelled, and JAX's exit would wait for the peers. Process 0 first waits (up
    to ``wait_s``) for the others to leave, since they abort when its coordination
    service goes before them. One process: flushes and exits."""
    if _peers is not None:
        _peers.mark(note)
        if _peers.me == 0:
            _peers.wait_for_others(wait_s)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(exit_code)

"""Many processes, one run: ``jax.distributed`` set-up, the peer heartbeats that name a
lost process, and the errors that name it.

Every process runs the same program; a step's devices span all of them, and each
process passes only the rows of the chunks whose devices it holds, in the step's
device order. The health table is global, so every process reaches the same verdict
inside the step and raises the same error. Processes meet in the coordination service
of ``jax.distributed`` (on process 0), whose key-value store carries host names,
heartbeats and the root-cause claim (``_failing.py``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep._src.core import Failure
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import log
from jaxstep._src.core.processes import KEY
from jaxstep._src.core.processes import client as _client
from jaxstep._src.core.processes import host_name as host_name
from jaxstep._src.core.processes import local_batch as local_batch
from jaxstep._src.core.processes import local_positions as local_positions
from jaxstep._src.core.processes import local_rows as local_rows
from jaxstep._src.core.processes import local_rows_per_device as local_rows_per_device
from jaxstep._src.core.processes import place_local_batch as place_local_batch
from jaxstep._src.core.processes import process_pid as process_pid
from jaxstep._src.core.processes import spans_processes as spans_processes
from jaxstep._src.distributed._heartbeats import PeerHeartbeats

#: ``"JAXSTEP_COORDINATOR"``: the coordinator's ``host:port``, set by
#: ``python -m jaxstep.launch`` for each process it starts.
ENV_COORDINATOR = "JAXSTEP_COORDINATOR"
#: ``"JAXSTEP_NUM_PROCESSES"``: how many processes the launcher started.
ENV_NUM_PROCESSES = "JAXSTEP_NUM_PROCESSES"
#: ``"JAXSTEP_PROCESS_ID"``: this process's index, from the launcher.
ENV_PROCESS_ID = "JAXSTEP_PROCESS_ID"
#: ``"JAXSTEP_LOST_TIMEOUT"``: seconds before a silent peer is lost (default
#: :data:`DEFAULT_LOST_TIMEOUT`).
ENV_LOST_TIMEOUT = "JAXSTEP_LOST_TIMEOUT"

#: Seconds (10.0) without a heartbeat from a process before the others declare it
#: lost, unless ``$JAXSTEP_LOST_TIMEOUT`` or ``initialize(lost_timeout=...)`` says
#: otherwise. Below XLA's ~40 s abort of a CPU collective with a missing peer, and
#: below the coordination service's own heartbeat timeout (100 s), which kills every
#: process without a word.
DEFAULT_LOST_TIMEOUT = 10.0


def is_multiprocess() -> bool:
    """Whether this run spans more than one process.

    Returns:
      True after ``jax.distributed`` joined several processes.

    Example:
      >>> from jaxstep.distributed import is_multiprocess
      >>> is_multiprocess()  # one process, without jax.distributed
      False
    """
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
      ValueError: ``lost_timeout`` is not above 0 and below
        ``heartbeat_timeout_seconds``, the launcher's environment variables are
        malformed, or no multi-process environment was found (the message says what to
        pass).

    Example:
      At the top of each process's script, before any JAX computation (run it as
      ``python -m jaxstep.launch -n 2 train.py``, or on a TPU VM slice as is)::

          import jaxstep

          jaxstep.distributed.initialize(lost_timeout=20)
          step = jaxstep.make_train_step(loss_fn, optimizer)  # spans every process

      A timeout the coordination service would beat is refused before anything starts:

      >>> from jaxstep.distributed import initialize
      >>> initialize(lost_timeout=200)
      Traceback (most recent call last):
      ValueError: lost_timeout=200 s must be below heartbeat_timeout_seconds=100: ...
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

    Raises:
      ValueError: ``lost_timeout`` is not above 0.

    Example:
      >>> from jaxstep.distributed import watch
      >>> print(watch())  # one process: no peers to watch
      None
    """
    global _peers
    client = _client()
    if client is None or _peers is not None:
        return _peers
    me = jax.process_index()
    client.key_value_set(
        f"{KEY}host/{me}",
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
    """This process's peer heartbeats, as :func:`watch` started them.

    Only whole processes are watched here; a hung step on this process's own
    devices is the step watchdog's (``fit(step_timeout=...)``).

    Returns:
      The :class:`PeerHeartbeats` (their ``lost()`` names the processes declared lost
      so far, and why), or None before :func:`watch` (or :func:`initialize`) ran, and
      outside a multi-process run.

    Example:
      >>> from jaxstep.distributed import monitor
      >>> print(monitor())  # one process: no heartbeats run
      None
    """
    return _peers


def lost_processes() -> dict[int, str]:
    """The processes the peer heartbeats declared lost so far.

    Returns:
      ``{process index: why}``; empty while every process beats, and outside a
      multi-process run.

    Example:
      >>> from jaxstep.distributed import lost_processes
      >>> lost_processes()  # one process: none to lose
      {}
    """
    return {} if _peers is None else _peers.lost()


def wait_ready(array: jax.Array, step: int, devices: Sequence[jax.Device]) -> None:
    """Returns once ``array`` (a step's output) is ready. While it is not, watches for
    lost processes, and raises their error instead of waiting for a peer that will
    never come (single process: returns at once; the caller's read waits).

    Args:
      array: an output of the step (its health table, say).
      step: the step's number, for the error.
      devices: the step's devices, for the error.

    Raises:
      TrainingWorkerError: a process of the run is lost (status ``HUNG``, naming its
        devices), after the Python stacks went to the ``jaxstep`` logger.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from jaxstep.distributed import wait_ready
      >>> health = jnp.zeros(8)
      >>> wait_ready(health, 0, jax.devices())  # one process: returns at once
      >>> health.tolist()[:2]
      [0.0, 0.0]
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
    finish: a peer is lost, or ``err`` is a hang.

    Args:
      array: an output of the newest dispatched step.
      err: the exception about to be raised.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxstep.distributed import finish_in_flight
      >>> finish_in_flight(jnp.zeros(8), ValueError("a bug"))  # one process: returns at once
    """
    if _peers is None or (isinstance(err, TrainingWorkerError) and err.status & Status.HUNG):
        return
    deadline = time.monotonic() + _peers.timeout
    while not array.is_ready() and time.monotonic() < deadline:  # type: ignore[attr-defined]
        if _peers.lost():
            return
        time.sleep(0.005)


def lost_after(err: BaseException, step: int, devices: Sequence[jax.Device]) -> BaseException:
    """What to raise for a runtime error from a collective: a dead peer's socket can
    fail the collective before the heartbeats run out, so this waits for them (at most
    the lost timeout).

    Args:
      err: the runtime's error.
      step: the step's number, for the error.
      devices: the step's devices, for the error.

    Returns:
      The lost-process error (:func:`lost_error`) if a peer turns out lost in time,
      else ``err`` itself.

    Example:
      >>> import jax
      >>> from jaxstep.distributed import lost_after
      >>> err = RuntimeError("gloo: connection closed by peer")
      >>> lost_after(err, 3, jax.devices()) is err  # no peer lost: the error itself
      True
    """
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
    """The error naming every device of each lost process, after logging the Python
    stacks (:func:`log_stacks`).

    Args:
      lost: ``{process index: why}``, as :func:`lost_processes` returns it.
      step: the step that cannot finish.
      devices: the step's devices.

    Returns:
      A :class:`jaxstep.TrainingWorkerError` with status ``HUNG`` for each device of
      the lost processes, and no state (a lost process's state cannot be read).

    Example:
      >>> import jax
      >>> from jaxstep.distributed import lost_error
      >>> err = lost_error({0: "it stopped sending heartbeats"}, 3, jax.devices()[:2])
      >>> [(f.device_id, f.status.name, f.step) for f in err.failures]
      [(0, 'HUNG', 3), (1, 'HUNG', 3)]
      >>> print(err.state)
      None
    """
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
    """Logs every Python thread's stack to the ``jaxstep`` logger, as an error (before
    raising a hang).

    Args:
      why: the first line of the message.

    Example:
      >>> import logging
      >>> from jaxstep.distributed import log_stacks
      >>> class Keep(logging.Handler):
      ...     def emit(self, record):
      ...         self.first = record.getMessage().splitlines()[0]
      >>> keep = Keep()
      >>> logging.getLogger("jaxstep").addHandler(keep)
      >>> log_stacks("step 3 cannot finish")
      >>> keep.first
      'step 3 cannot finish; Python stacks:'
      >>> logging.getLogger("jaxstep").removeHandler(keep)
    """
    stacks = "\n".join(
        f"--- thread {ident}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )
    log.error("%s; Python stacks:\n%s", why, stacks)

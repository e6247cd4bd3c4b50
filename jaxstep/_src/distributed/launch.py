"""``python -m jaxstep.launch -n 2 train.py ARGS``: try a multi-host run on one machine.

Starts N copies of a script (or ``-m module``) as processes 0..N-1 of one
``jax.distributed`` job on 127.0.0.1, each with its own fake CPU devices, forwards their
output line by line with a ``[pN]`` prefix, and stops the others when one fails (after
a grace period in which they can reach the same verdict on their own and write their
error reports). The exit code is 0 when every process succeeded, else the first
failure's. With ``--restarts N`` the whole job starts again (up to N times) when the
first process to fail exited with ``RESTART_EXIT_CODE`` (75: ``fit(recover=...)`` after
a hang or a lost peer) or was killed by a signal; any other failure is final. The
script calls :func:`jaxstep.distributed.initialize`, which reads::

    JAXSTEP_COORDINATOR=127.0.0.1:PORT  JAXSTEP_NUM_PROCESSES=N  JAXSTEP_PROCESS_ID=i
    JAXSTEP_ERROR_DIR=DIR (with --error-dir)  JAX_NUM_CPU_DEVICES=K  JAX_PLATFORMS=cpu

and ``JAXSTEP_RESTART`` is the attempt (0 first, 1 after the first restart).

This is a tool for a laptop or CI; on TPU VMs and clusters the scheduler starts the
processes and ``jax.distributed`` finds its peers itself (see ``docs/multihost.md``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO
from typing import NamedTuple

from jaxstep._src.core import ENV_RESTART
from jaxstep._src.core import RESTART_EXIT_CODE
from jaxstep._src.distributed import reports
from jaxstep._src.distributed._ports import free_port
from jaxstep._src.distributed._ports import unreserve


def child_env(
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int,
    error_dir: str | None,
    base: dict[str, str] | None = None,
    *,
    restart: int = 0,
) -> dict[str, str]:
    """The environment of one process of a local job: where to meet, who it is, its
    devices, and which attempt of the job this is.

    Args:
      process_id: the process's index.
      num_processes: how many processes the job has.
      port: the coordinator's port on 127.0.0.1.
      devices_per_process: fake CPU devices in each process.
      error_dir: where error reports go (``$JAXSTEP_ERROR_DIR``), or None.
      base: the environment to start from (default ``os.environ``).
      restart: the attempt (``$JAXSTEP_RESTART``; 0 first).

    Returns:
      A new dict of environment variables.

    Example:
      >>> from jaxstep.launch import child_env
      >>> env = child_env(1, 2, 12345, devices_per_process=4, error_dir=None, base={})
      >>> env["JAXSTEP_COORDINATOR"], env["JAXSTEP_PROCESS_ID"], env["JAX_NUM_CPU_DEVICES"]
      ('127.0.0.1:12345', '1', '4')
    """
    env = dict(os.environ if base is None else base)
    env.update(
        JAXSTEP_COORDINATOR=f"127.0.0.1:{port}",
        JAXSTEP_NUM_PROCESSES=str(num_processes),
        JAXSTEP_PROCESS_ID=str(process_id),
        JAX_NUM_CPU_DEVICES=str(devices_per_process),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",  # lines arrive as they are printed, not at exit
    )
    # A device count forced through XLA_FLAGS would override the per-process one.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    env[ENV_RESTART] = str(restart)
    if error_dir is not None:
        env[reports.ENV_ERROR_DIR] = os.path.abspath(error_dir)
    return env


#: gloo's line for each group of CPU collectives it connects (one per group and process:
#: 15 to 23 for a 2 x 4 run), which says nothing a user acts on: not relayed
GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of "
    r"connected peer ranks is : \d+"
)
#: the words of that line: gloo's threads write it in pieces, and two threads writing
#: at once tear it (pieces of two lines on one, a line's tail on the next)
_GLOO_WORDS = frozenset(
    {
        "[Gloo]",
        "Rank",
        "is",
        "connected",
        "to",
        "peer",
        "ranks",
        "ranks.",
        "Expected",
        "number",
        "of",
        ":",
    }
)


class GlooFilter:
    """Which of a process's output lines the launcher relays: every line but gloo's
    connection lines, whole or torn. A line is gloo's when, once its whole gloo lines
    are cut out, what is left is only gloo's words and numbers, and it holds a piece no
    user line has (``[Gloo]``, ``peer ranks``) or it follows a line that gloo left
    unfinished (a torn line's tail, down to a bare number).

    >>> f = GlooFilter()
    >>> f.keep("[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of "
    ...        "connected peer ranks is : 7")
    >>> f.keep("[Gloo] Rank 1 is connected to [Gloo] Rank 2 is connected to 7 peer ranks.")
    >>> f.keep("7 peer ranks. Expected number of connected peer ranks is : 7")
    >>> f.keep("step 3 loss 0.5")
    'step 3 loss 0.5'
    """

    def __init__(self) -> None:
        #: gloo left its last line unfinished: the next line may carry its tail
        self.torn = False

    def keep(self, line: str) -> str | None:
        """``line`` as it should be relayed, or None for a line of gloo's alone."""
        rest = GLOO_CONNECTED.sub(" ", line)
        words = rest.split()
        gloo_only = all(w in _GLOO_WORDS or w.rstrip(".").isdigit() for w in words)
        piece = "[Gloo]" in rest or "peer ranks" in rest
        if words and gloo_only and (piece or self.torn):
            # unfinished unless it ends as gloo's line does: "... is : N"
            self.torn = not (len(words) > 1 and words[-2] == ":" and words[-1].isdigit())
            return None
        self.torn = False
        if not words and rest != line:  # whole gloo lines, nothing else
            return None
        return line if rest == line else " ".join(rest.split())


def _forward(
    index: int, stream: IO[bytes], out: IO[str], lock: threading.Lock, show_gloo: bool = False
) -> None:
    gloo = GlooFilter()
    for raw in iter(stream.readline, b""):
        text = raw.decode("utf-8", "replace").rstrip("\n")
        line = text if show_gloo else gloo.keep(text)
        if line is None:
            continue
        with lock:
            out.write(f"[p{index}] {line}\n")
            out.flush()


class _Job(NamedTuple):
    """What every attempt of one :func:`launch` runs, and where its output goes."""

    command: tuple[str, ...]
    num_processes: int
    devices_per_process: int
    error_dir: str | None
    grace: float
    out: IO[str]
    lock: threading.Lock
    show_gloo: bool


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int = 4,
    error_dir: str | None = None,
    grace: float = 60.0,
    timeout: float | None = None,
    out: IO[str] | None = None,
    restarts: int = 0,
    show_gloo: bool = False,
) -> int:
    """Runs ``command`` as processes 0..num_processes-1 of one local job.

    Args:
      command: the argv of one process, e.g. ``[sys.executable, "train.py", "--steps", "9"]``.
      num_processes: how many processes.
      devices_per_process: fake CPU devices in each.
      error_dir: where each process writes its JSON error report (and where this
        launcher writes one for a process that died without writing its own); on a
        restart the attempt's reports move to ``error_dir/attempt-K/``.
      grace: seconds the others get, after the first process fails, to fail on their
        own (the same verdict, a lost-process error) before they are terminated.
      timeout: seconds for the whole job, restarts included (None: no limit); then
        every process is killed.
      out: where the prefixed output goes (default ``sys.stdout``).
      restarts: start the whole job again, up to this many times, when the first
        process to fail exited with ``RESTART_EXIT_CODE`` (75: ``fit(recover=...)``
        after a hang or a lost peer) or was killed by a signal (a crash). Any other
        exit code (1: a bug, an unrecovered ``TrainingWorkerError``) is final. Each
        process reads its attempt in ``$JAXSTEP_RESTART`` (0 first).
      show_gloo: relay gloo's connection lines too (one per group of collectives and
        process, torn when two of its threads write at once); by default none reaches
        ``out``, whole or torn.

    Returns:
      0 if every process of the last attempt exited with 0, else the exit code of the
      first that did not (128 + N for a signal N, 124 past ``timeout``).

    Raises:
      ValueError: ``num_processes``, ``devices_per_process`` or ``restarts`` is out of
        range.

    Example:
      Two processes of one device each, their lines prefixed by the process:

      >>> import io
      >>> import sys
      >>> from jaxstep.launch import launch
      >>> out = io.StringIO()
      >>> launch([sys.executable, "-c", "print('hello')"], num_processes=2,
      ...        devices_per_process=1, out=out)
      0
      >>> sorted(out.getvalue().splitlines())
      ['[p0] hello', '[p1] hello']
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
    out = sys.stdout if out is None else out
    if error_dir is not None:
        os.makedirs(error_dir, exist_ok=True)
    lock = threading.Lock()
    job = _Job(
        tuple(command), num_processes, devices_per_process, error_dir, grace, out, lock, show_gloo
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    for attempt in range(restarts + 1):
        first = _attempt(job, attempt, deadline)
        if first is None:
            return 0
        who, code = first
        why = _restart_reason(code)
        if why is None:
            return _exit_code(code)
        if attempt == restarts:
            _note(out, lock, f"process {who} {why}; no restart left (--restarts {restarts})")
            return _exit_code(code)
        _note(out, lock, f"process {who} {why}; restarting the job ({attempt + 1} of {restarts})")
        if error_dir is not None:
            _set_aside(error_dir, attempt)
    raise AssertionError("not reached")


def _attempt(job: _Job, attempt: int, deadline: float | None) -> tuple[int, int] | None:
    """One run of the job; returns the first process to fail and its return code
    (negative: a signal; ``(-1, 124)`` past the deadline), or None when all succeeded."""
    num_processes, grace, out, lock = job.num_processes, job.grace, job.out, job.lock
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    threads = []
    for i in range(num_processes):
        env = child_env(
            i, num_processes, port, job.devices_per_process, job.error_dir, restart=attempt
        )
        proc = subprocess.Popen(
            list(job.command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal to the launcher's group does not hit them twice
        )
        procs.append(proc)
        assert proc.stdout is not None
        t = threading.Thread(
            target=_forward, args=(i, proc.stdout, out, lock, job.show_gloo), daemon=True
        )
        t.start()
        threads.append(t)

    first_failure: tuple[int, int] | None = None  # (process, return code)
    failed_at: float | None = None
    codes: dict[int, int] = {}
    try:
        while len(codes) < num_processes:
            for i, proc in enumerate(procs):
                if i in codes or proc.poll() is None:
                    continue
                code = proc.returncode
                codes[i] = _exit_code(code)
                if codes[i] != 0:
                    _note(out, lock, f"process {i} exited with {_describe(code)}")
                    if first_failure is None:
                        first_failure, failed_at = (i, code), time.monotonic()
            now = time.monotonic()
            if failed_at is not None and first_failure is not None and now - failed_at > grace:
                who = first_failure[0]
                _note(out, lock, f"stopping the others {grace:g} s after process {who} failed")
                _stop(procs, codes)
                failed_at = None
            if deadline is not None and now > deadline:
                _note(out, lock, "the job ran past --timeout: stopping it")
                _stop(procs, codes)
                first_failure = first_failure or (-1, 124)
                deadline = None
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, codes)
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
        unreserve(port)  # the run is over: its port is free
    for i, proc in enumerate(procs):
        codes.setdefault(i, _exit_code(proc.returncode))
    if job.error_dir is not None and any(codes.values()):
        ended = {i: procs[i].returncode for i in codes}  # in the order they ended
        reports.complete(job.error_dir, ended, procs)
    return first_failure


def _exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it: 128 + N for a signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def _restart_reason(returncode: int) -> str | None:
    """Why a job whose first failure is ``returncode`` is restarted, or None: it is not."""
    if returncode == RESTART_EXIT_CODE:
        return f"exited with code {RESTART_EXIT_CODE} (restart requested)"
    if returncode < 0:
        return f"was killed by signal {signal.Signals(-returncode).name} (a crash)"
    return None


def _set_aside(error_dir: str, attempt: int) -> None:
    """Moves an attempt's error reports to ``error_dir/attempt-K/``: the next attempt's
    reports, and the launcher's completion of them, start from an empty directory."""
    found = sorted(Path(error_dir).glob("error-p*.json"))
    if found:
        aside = Path(error_dir) / f"attempt-{attempt}"
        aside.mkdir(exist_ok=True)
        for path in found:
            path.replace(aside / path.name)


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _note(out: IO[str], lock: threading.Lock, text: str) -> None:
    with lock:
        out.write(f"[launch] {text}\n")
        out.flush()


def _stop(procs: Sequence[subprocess.Popen[bytes]], codes: dict[int, int]) -> None:
    """SIGTERM to each process still running, SIGKILL 5 s later."""
    alive = [p for i, p in enumerate(procs) if i not in codes and p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + 5
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m jaxstep.launch [-n N] [--restarts N] ...
    script.py ARGS`` (``--help`` lists every option).

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      The job's exit code, as :func:`launch` returns it.

    Example:
      >>> import pathlib
      >>> import tempfile
      >>> from jaxstep.launch import main
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     script = pathlib.Path(tmp, "train.py")
      ...     _ = script.write_text("import os; print('process', os.environ['JAXSTEP_PROCESS_ID'])")
      ...     code = main(["-n", "1", "--devices-per-process", "1", str(script)])
      [p0] process 0
      >>> code
      0
    """
    parser = argparse.ArgumentParser(
        prog="python -m jaxstep.launch",
        description="Run a training script as N local jax.distributed processes on fake "
        "CPU devices (127.0.0.1, collectives through gloo).",
    )
    parser.add_argument("-n", "--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--error-dir", help="one JSON error report per failed process goes here")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole job")
    parser.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="N",
        help="start the job again, up to N times, when a process exits with code 75 "
        "(fit(recover=...) after a hang or a lost peer) or is killed by a signal; any other "
        "failure is final (default 0)",
    )
    parser.add_argument(
        "--show-gloo",
        action="store_true",
        help="relay gloo's connection lines too (left out by default)",
    )
    parser.add_argument("-m", dest="module", help="run a module (python -m MODULE) instead")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
    if ns.restarts < 0:
        parser.error(f"--restarts must be >= 0, got {ns.restarts}")
    if ns.module is None and ns.script is None:
        parser.error("give a script (train.py ARGS) or a module (-m MODULE ARGS)")
    if ns.module is not None:
        rest = ([ns.script] if ns.script is not None else []) + ns.args
        command = [sys.executable, "-m", ns.module, *rest]
    else:
        command = [sys.executable, ns.script, *ns.args]
    return launch(
        command,
        num_processes=ns.num_processes,
        devices_per_process=ns.devices_per_process,
        error_dir=ns.error_dir,
        grace=ns.grace,
        timeout=ns.timeout,
        restarts=ns.restarts,
        show_gloo=ns.show_gloo,
    )


if __name__ == "__main__":
    sys.exit(main())

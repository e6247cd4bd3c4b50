"""``python -m jaxstep.launch -n 2 train.py ARGS``: try a multi-host run on one machine.

Starts N copies of a script (or ``-m module``) as processes 0..N-1 of one
``jax.distributed`` job on 127.0.0.1, each with its own fake CPU devices, forwards their
output line by line with a ``[pN]`` prefix, and stops the others when one fails (after
a grace period in which they can reach the same verdict on their own and write their
error reports). The exit code is 0 when every process succeeded, else the first
failure's. The script calls :func:`jaxstep.distributed.initialize`, which reads::

    JAXSTEP_COORDINATOR=127.0.0.1:PORT  JAXSTEP_NUM_PROCESSES=N  JAXSTEP_PROCESS_ID=i
    JAXSTEP_ERROR_DIR=DIR (with --error-dir)  JAX_NUM_CPU_DEVICES=K  JAX_PLATFORMS=cpu

This is a tool for a laptop or CI; on TPU VMs and clusters the scheduler starts the
processes and ``jax.distributed`` finds its peers itself (see ``docs/multihost.md``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from jaxstep.distributed import reports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(
    process_id: int,
    num_processes: int,
    port: int,
    devices_per_process: int,
    error_dir: str | None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``process_id``: where to meet, who it is, its devices."""
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
    if error_dir is not None:
        env[reports.ENV_ERROR_DIR] = os.path.abspath(error_dir)
    return env


def _forward(index: int, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(f"[p{index}] {line}\n")
            out.flush()


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int = 4,
    error_dir: str | None = None,
    grace: float = 60.0,
    timeout: float | None = None,
    out: IO[str] | None = None,
) -> int:
    """Runs ``command`` as processes 0..num_processes-1 of one local job.

    Args:
      command: the argv of one process, e.g. ``[sys.executable, "train.py", "--steps", "9"]``.
      num_processes: how many processes.
      devices_per_process: fake CPU devices in each.
      error_dir: where each process writes its JSON error report (and where this
        launcher writes one for a process that died without writing its own).
      grace: seconds the others get, after the first process fails, to fail on their
        own (the same verdict, a lost-process error) before they are terminated.
      timeout: seconds for the whole job (None: no limit); then every process is killed.
      out: where the prefixed output goes (default ``sys.stdout``).

    Returns:
      0 if every process exited with 0, else the exit code of the first that did not
      (128 + N for a signal N).
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    out = sys.stdout if out is None else out
    if error_dir is not None:
        os.makedirs(error_dir, exist_ok=True)
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    threads = []
    for i in range(num_processes):
        env = child_env(i, num_processes, port, devices_per_process, error_dir)
        proc = subprocess.Popen(
            list(command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal to the launcher's group does not hit them twice
        )
        procs.append(proc)
        assert proc.stdout is not None
        t = threading.Thread(target=_forward, args=(i, proc.stdout, out, lock), daemon=True)
        t.start()
        threads.append(t)

    start = time.monotonic()
    first_failure: tuple[int, int] | None = None  # (process, code)
    failed_at: float | None = None
    codes: dict[int, int] = {}
    try:
        while len(codes) < num_processes:
            for i, proc in enumerate(procs):
                if i in codes or proc.poll() is None:
                    continue
                code = proc.returncode
                codes[i] = code if code >= 0 else 128 - code
                if codes[i] != 0:
                    _note(out, lock, f"process {i} exited with {_describe(code)}")
                    if first_failure is None:
                        first_failure, failed_at = (i, codes[i]), time.monotonic()
            now = time.monotonic()
            if failed_at is not None and first_failure is not None and now - failed_at > grace:
                who = first_failure[0]
                _note(out, lock, f"stopping the others {grace:g} s after process {who} failed")
                _stop(procs, codes)
                failed_at = None
            if timeout is not None and now - start > timeout:
                _note(out, lock, f"the job ran past --timeout {timeout:g} s: stopping it")
                _stop(procs, codes)
                first_failure = first_failure or (-1, 124)
                timeout = None
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(procs, codes)
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
    for i, proc in enumerate(procs):
        codes.setdefault(i, proc.returncode if proc.returncode >= 0 else 128 - proc.returncode)
    if error_dir is not None and any(codes.values()):
        ended = {i: procs[i].returncode for i in codes}  # in the order they ended
        reports.complete(error_dir, ended, procs)
    if first_failure is None:
        return 0
    return first_failure[1]


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
    parser.add_argument("-m", dest="module", help="run a module (python -m MODULE) instead")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(argv)
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
    )


if __name__ == "__main__":
    sys.exit(main())

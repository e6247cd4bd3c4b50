"""JSON error reports, one file per failed process: ``{dir}/error-p{process_index}.json``.

Each process that fails writes what happened there (process, host, pid, the failing
device, step, status, reason, traceback, time); the report of the failure that
started it all has ``"root_cause": true`` (torchrun's convention: the earliest
failure; :func:`jaxstep.distributed.write_error_report` says how the processes agree on
it). The directory comes from an argument or ``$JAXSTEP_ERROR_DIR``. This module needs
no JAX, so a launcher can read and complete the reports.

Each process writes its own with :func:`jaxstep.distributed.write_error_report` (or the
:func:`jaxstep.distributed.record` decorator); :func:`root_cause` reads the one to look
at first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import socket
import time
import traceback
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    import subprocess

    from jaxstep._src.core import Failure

#: The environment variable naming the directory reports go to; unset, no reports.
ENV_ERROR_DIR = "JAXSTEP_ERROR_DIR"

__all__ = [
    "ENV_ERROR_DIR",
    "build",
    "complete",
    "error_dir",
    "read",
    "report_path",
    "root_cause",
    "write",
]


def error_dir(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Where reports go.

    Args:
      path: a directory, or None for ``$JAXSTEP_ERROR_DIR``.

    Returns:
      ``path``, else ``$JAXSTEP_ERROR_DIR``, else None (no reports).

    Example:
      >>> import os
      >>> from jaxstep.distributed import reports
      >>> reports.error_dir("errors")
      PosixPath('errors')
      >>> from unittest import mock
      >>> with mock.patch.dict(os.environ, {reports.ENV_ERROR_DIR: "run/errors"}):
      ...     print(reports.error_dir())
      run/errors
    """
    chosen = path if path is not None else os.environ.get(ENV_ERROR_DIR)
    return Path(chosen) if chosen else None


def report_path(directory: str | os.PathLike[str], process_index: int) -> Path:
    """The report file of a process.

    Args:
      directory: the reports' directory.
      process_index: the process.

    Returns:
      ``{directory}/error-p{process_index}.json``.

    Example:
      >>> from jaxstep.distributed import reports
      >>> reports.report_path("errors", 3).as_posix()
      'errors/error-p3.json'
    """
    return Path(directory) / f"error-p{process_index}.json"


def _failure_dict(failure: Failure) -> dict[str, Any]:
    out = dataclasses.asdict(failure)
    out["status"] = str(getattr(failure.status, "name", failure.status))
    out["status_value"] = int(failure.status)
    return out


def build(
    exc: BaseException,
    *,
    process_index: int,
    root_cause: bool,
    root_cause_process: int | None,
    host: str | None = None,
) -> dict[str, Any]:
    """The report of ``exc`` as raised in this process.

    Args:
      exc: the exception.
      process_index: this process.
      root_cause: whether this report is the root cause's.
      root_cause_process: the process where the failure started, if known.
      host: this process's host name (default: ``socket.gethostname()``).

    Returns:
      A plain JSON-able dict: ``process_index``, ``host``, ``pid``, ``time``,
      ``time_utc``, ``exception``, ``message``, ``traceback``, ``root_cause``,
      ``root_cause_process``, and for a :class:`jaxstep.TrainingWorkerError` the
      failing ``device_id``, ``device_process_index``, ``device_host``, ``step``,
      ``status``, ``reason``, ``leaf`` and every ``failures`` entry.

    Example:
      >>> from jaxstep.distributed import reports
      >>> report = reports.build(
      ...     ValueError("bad batch"), process_index=1, root_cause=True, root_cause_process=1,
      ...     host="node-1")
      >>> report["host"], report["exception"], report["reason"], report["root_cause"]
      ('node-1', 'ValueError', 'bad batch', True)
    """
    now = time.time()
    report: dict[str, Any] = {
        "process_index": process_index,
        "host": host or socket.gethostname(),
        "pid": os.getpid(),
        "time": now,
        "time_utc": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
        "exception": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "root_cause": root_cause,
        "root_cause_process": root_cause_process,
        "device_id": None,
        "device_process_index": None,
        "device_host": None,
        "step": None,
        "status": None,
        "reason": (str(exc).split("\n", 1)[0])[:500],
        "leaf": None,
        "failures": [],
    }
    failures = getattr(exc, "failures", None)
    if failures:
        first = failures[0]
        report.update(
            device_id=first.device_id,
            device_process_index=first.process_index,
            device_host=getattr(first, "host", None),
            step=first.step,
            status=str(getattr(first.status, "name", first.status)),
            reason=first.reason,
            leaf=first.leaf,
            failures=[_failure_dict(f) for f in failures],
        )
    return report


def write(report: Mapping[str, Any], directory: str | os.PathLike[str]) -> Path:
    """Writes one report atomically (a reader never sees half a file).

    Args:
      report: a report (:func:`build`).
      directory: the reports' directory (made if missing).

    Returns:
      The file written (:func:`report_path`).

    Raises:
      OSError: the directory cannot be made or written.

    Example:
      >>> import tempfile
      >>> from jaxstep.distributed import reports
      >>> report = reports.build(OSError("disk full"), process_index=2, root_cause=False,
      ...                        root_cause_process=None)
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     print(reports.write(report, errors).name)
      error-p2.json
    """
    path = report_path(directory, int(report["process_index"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every report in ``directory``.

    Args:
      directory: the reports' directory.

    Returns:
      ``{process index: report}``; empty when there is none.

    Example:
      >>> import tempfile
      >>> from jaxstep.distributed import reports
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     for p in (0, 1):
      ...         report = reports.build(ValueError(f"p{p}"), process_index=p, root_cause=False,
      ...                                root_cause_process=None)
      ...         _ = reports.write(report, errors)
      ...     found = reports.read(errors)
      >>> {p: r["message"] for p, r in found.items()}
      {0: 'p0', 1: 'p1'}
    """
    out = {}
    for path in sorted(Path(directory).glob("error-p*.json")):
        report = json.loads(path.read_text())
        out[int(report["process_index"])] = report
    return out


def root_cause(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The report of the failure that started it all.

    Args:
      directory: the reports' directory.

    Returns:
      The report marked as the root cause, else the earliest one, else None.

    Example:
      >>> import tempfile
      >>> from jaxstep.distributed import reports
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     for p, first in ((0, False), (1, True)):
      ...         report = reports.build(RuntimeError(f"p{p} failed"), process_index=p,
      ...                                root_cause=first, root_cause_process=1)
      ...         _ = reports.write(report, errors)
      ...     cause = reports.root_cause(errors)
      >>> cause["process_index"], cause["message"]
      (1, 'p1 failed')
    """
    found = read(directory)
    marked = [r for r in found.values() if r.get("root_cause")]
    pool = marked or list(found.values())
    return min(pool, key=lambda r: r["time"]) if pool else None


def complete(
    directory: str | os.PathLike[str],
    returncodes: Mapping[int, int | None],
    procs: Sequence[subprocess.Popen[bytes]] | None = None,
) -> None:
    """After a local job: a report for each process that failed without writing one
    (killed by a signal, crashed in C++), and a root cause marked if none is.

    A process that died without a word is the likeliest root cause: the others'
    reports then name it as lost, and do not claim the root cause themselves.

    Args:
      directory: the reports' directory.
      returncodes: each process's exit code (negative: a signal; None: still running),
        in the order the processes ended.
      procs: the processes, by index (for their pids), when known.

    Example:
      A process killed by SIGKILL left no report: the launcher writes one, marked the root
      cause:

      >>> import tempfile
      >>> from jaxstep.distributed import reports
      >>> with tempfile.TemporaryDirectory() as errors:
      ...     reports.complete(errors, {1: -9, 0: 1})
      ...     cause = reports.root_cause(errors)
      >>> cause["process_index"], cause["reason"]
      (1, 'killed by signal SIGKILL')
    """
    found = read(directory)
    silent = [i for i, code in returncodes.items() if code and i not in found]
    for i in silent:
        code = returncodes[i]
        assert code is not None
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        pid = procs[i].pid if procs is not None else None
        now = time.time()
        write(
            {
                "process_index": i,
                "host": socket.gethostname(),
                "pid": pid,
                "time": now,
                "time_utc": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(),
                "exception": None,
                "message": f"process {i} died without an error report ({how})",
                "traceback": None,
                "root_cause": False,
                "root_cause_process": None,
                "device_id": None,
                "device_process_index": None,
                "device_host": None,
                "step": None,
                "status": None,
                "reason": how,
                "leaf": None,
                "failures": [],
                "written_by": "jaxstep.launch",
            },
            directory,
        )
    found = read(directory)
    if not found or any(r.get("root_cause") for r in found.values()):
        return
    # The one the others blame, else a silent death, else the earliest report.
    blamed = [
        r["root_cause_process"] for r in found.values() if r.get("root_cause_process") is not None
    ]
    if blamed and blamed[0] in found:
        chosen = found[blamed[0]]
    elif silent:
        chosen = found[silent[0]]
    else:
        chosen = min(found.values(), key=lambda r: r["time"])
    chosen["root_cause"] = True
    write(chosen, directory)

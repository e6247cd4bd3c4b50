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

from jaxstep._src.distributed.reports import ENV_ERROR_DIR as ENV_ERROR_DIR
from jaxstep._src.distributed.reports import build as build
from jaxstep._src.distributed.reports import complete as complete
from jaxstep._src.distributed.reports import error_dir as error_dir
from jaxstep._src.distributed.reports import read as read
from jaxstep._src.distributed.reports import report_path as report_path
from jaxstep._src.distributed.reports import root_cause as root_cause
from jaxstep._src.distributed.reports import write as write

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

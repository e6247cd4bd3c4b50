"""A hang or a lost peer under ``fit(recover=...)``: after the emergency save the
process says why on stderr and exits with :data:`RESTART_EXIT_CODE`, so that its
launcher (``python -m jaxstep.launch --restarts N``, ``scripts/tpu_vm/launch.sh
--restarts N``) starts the job again from the last verified checkpoint. Only under such
a launcher (``$JAXSTEP_RESTART`` set: :func:`jaxstep._src.core.under_restarting_launcher`):
elsewhere (a notebook's kernel, a plain script) the error is raised, saying why
(:func:`not_restarted`)."""

from __future__ import annotations

import sys
from typing import NoReturn

from jaxstep._src import distributed
from jaxstep._src.core import ENV_RESTART
from jaxstep._src.core import RESTART_EXIT_CODE
from jaxstep._src.core import Status
from jaxstep._src.core import TrainingWorkerError
from jaxstep._src.core import log


def exit_for_restart(error: TrainingWorkerError) -> NoReturn:
    """Writes ``error`` (its whole message: the hung devices or the lost process, the
    emergency save, the latest verified checkpoint) and its error report, then leaves
    with ``os._exit(RESTART_EXIT_CODE)``.

    Not ``sys.exit``: a ``SystemExit`` raised in ``fit`` runs its early-stop path (which
    takes it for a Ctrl-C: "the state was lost") and the user's own handlers, which may
    wait on the hung step; and with several processes JAX's exit waits for the missing
    peer (docs/multihost.md, "Leaving"). Several processes: the others are told at once
    and process 0 waits for them first (:func:`jaxstep.distributed.leave`).
    """
    report = None
    try:
        report = distributed.write_error_report(error)  # $JAXSTEP_ERROR_DIR, if set
    except Exception:  # never let a report hide the exit
        log.exception("jaxstep: writing the error report failed")
    if error.checkpoint is not None:
        then = "fit(..., resume=True) then goes on from the latest verified checkpoint named above"
    else:
        then = "without fit(checkpoint_dir=...) nothing was saved: the restarted job starts over"
    lines = [
        f"jaxstep: {type(error).__name__}: {error}",
        *([f"jaxstep: error report written to {report}"] if report is not None else []),
        f"jaxstep: exiting with code {RESTART_EXIT_CODE} (jaxstep.RESTART_EXIT_CODE) so that "
        "the launcher restarts the job (python -m jaxstep.launch --restarts N, "
        f"scripts/tpu_vm/launch.sh --restarts N); {then}",
    ]
    print("\n".join(lines), file=sys.stderr, flush=True)
    distributed.leave(RESTART_EXIT_CODE, note="exited")


def is_hang(error: TrainingWorkerError) -> bool:
    """A hung step or a lost peer: no state can be read back (``error.state`` None)."""
    return error.state is None and Status.HUNG in error.status


def not_restarted(error: TrainingWorkerError) -> TrainingWorkerError:
    """``error`` (a hang under ``recover`` that no launcher restarts) with a note: why
    the process did not exit for a restart, and that it must be restarted."""
    return error.with_note(
        f"not exited for a restart: fit(recover=...) exits with code {RESTART_EXIT_CODE} only "
        f"under a launcher that restarts the job (${ENV_RESTART} set, as python -m "
        "jaxstep.launch --restarts N and scripts/tpu_vm/launch.sh do); here the error is "
        "raised instead, after the emergency save. This process cannot train again: "
        "restart it (in a notebook, restart the kernel)"
    )

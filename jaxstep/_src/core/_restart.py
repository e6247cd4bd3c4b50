"""The restart contract between a training process and the launcher that started it:
a process that cannot go on (a hung step, a lost peer, under ``fit(recover=...)``)
exits with :data:`RESTART_EXIT_CODE` after its emergency save when a launcher started
it (:func:`under_restarting_launcher`; elsewhere ``fit`` raises the error); the
launcher starts the job again and tells each process which attempt it is in
``$JAXSTEP_RESTART``."""

import os

#: The exit code (75, ``EX_TEMPFAIL`` in sysexits.h: a temporary failure, try again)
#: of a process that cannot go on after a hang, a lost peer, or a bad device it cannot
#: leave out (its process would keep none) under ``fit(recover=...)``, once its
#: emergency save is written. ``python -m jaxstep.launch --restarts N`` and
#: ``scripts/tpu_vm/launch.sh --restarts N`` start the job again on it, from the last
#: verified checkpoint; outside such a launcher ``fit`` raises the error instead.
RESTART_EXIT_CODE = 75

#: The environment variable a launcher sets to the attempt: 0 first, 1 after a restart.
ENV_RESTART = "JAXSTEP_RESTART"


def under_restarting_launcher() -> bool:
    """Whether a launcher that restarts the job on :data:`RESTART_EXIT_CODE` started
    this process: ``$JAXSTEP_RESTART`` is set (``python -m jaxstep.launch``,
    ``scripts/tpu_vm/launch.sh``; a launcher of one's own sets it too). Elsewhere (a
    notebook, a plain script) exiting would only lose what the process holds."""
    return os.environ.get(ENV_RESTART) is not None

"""The restart contract between a training process and the launcher that started it:
a process that cannot go on (a hung step, a lost peer, under ``fit(recover=...)``)
exits with :data:`RESTART_EXIT_CODE` after its emergency save; the launcher starts the
job again and tells each process which attempt it is in ``$JAXSTEP_RESTART``."""

#: EX_TEMPFAIL (sysexits.h): a temporary failure, try again. ``python -m jaxstep.launch
#: --restarts N`` and ``scripts/tpu_vm/launch.sh --restarts N`` restart the job on it.
RESTART_EXIT_CODE = 75

#: The environment variable a launcher sets to the attempt: 0 first, 1 after a restart.
ENV_RESTART = "JAXSTEP_RESTART"

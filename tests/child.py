"""What every process of a multi-process test does first, shared by the scripts that
``python -m jaxstep.launch`` runs by path (``multihost_child.py``, ``recover_child.py``).

A child joins the run (:func:`start`), feeds its own rows of the same global batches
(:func:`local_batches`), puts its faults on :func:`target` and prints what it saw
(:func:`result`), one line the tests read back by process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from jaxstep import distributed


def start(main: Callable[..., Any]) -> None:
    """Joins the run, then calls ``main(*sys.argv[1:])``. Call it under ``__main__``:
    before any computation, and never at import (pytest imports the children for
    doctests)."""
    distributed.initialize(lost_timeout=float(os.environ.get("CHILD_LOST_TIMEOUT", "6")))
    main(*sys.argv[1:])


def result(**fields: Any) -> None:
    """Prints ``RESULT {json}``: ``fields`` and which process saw them, and when."""
    fields.update(process=jax.process_index(), pid=os.getpid(), at=time.time())
    print("RESULT " + json.dumps(fields), flush=True)


def target(devices: Sequence[jax.Device]) -> jax.Device:
    """Process 1's second device (id 2049 on this JAX): where the tests' faults go."""
    return [d for d in devices if d.process_index == 1][1]


def local_batches(batches: Sequence[dict], devices: Sequence[jax.Device]) -> list[dict]:
    """This process's rows of each global batch, laid out for ``devices``."""
    return [distributed.local_batch(b, devices) for b in batches]

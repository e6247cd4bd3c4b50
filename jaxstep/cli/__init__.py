"""The ``jaxstep`` command: ``jaxstep demo`` and ``jaxstep doctor``, and the digits data
the demo trains on. Uses jaxstep's public API only."""

from jaxstep.cli._main import main as main

__all__ = ["main"]

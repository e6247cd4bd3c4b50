"""The ``jaxstep`` command: ``jaxstep demo`` (on the digits of :mod:`jaxstep.data`) and
``jaxstep doctor``. Built on the layers' faces, the testing kit and the data."""

from jaxstep._src.cli._main import main as main

__all__ = ["main"]

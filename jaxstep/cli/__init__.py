"""The ``jaxstep`` command: ``jaxstep demo`` and ``jaxstep doctor``, and the digits data
the demo trains on (public home: :mod:`jaxstep.data`). Built on the layers' faces and
the testing kit."""

from jaxstep.cli._main import main as main
from jaxstep.cli.data import Split as Split
from jaxstep.cli.data import batches as batches
from jaxstep.cli.data import digits as digits

__all__ = ["Split", "batches", "digits", "main"]

"""The path the docs gave for :func:`read_emergency` before the layers had folders;
its home is :mod:`jaxstep.checkpoint` (``jaxstep.checkpoint.read_emergency``)."""

from jaxstep.checkpoint import Emergency as Emergency
from jaxstep.checkpoint import read_emergency as read_emergency

__all__ = ["Emergency", "read_emergency"]

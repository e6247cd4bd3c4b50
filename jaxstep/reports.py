"""The path the docs gave for the error reports before the layers had folders; their
home is :mod:`jaxstep.distributed.reports` (``jaxstep.distributed.root_cause``)."""

from jaxstep.distributed.reports import build as build
from jaxstep.distributed.reports import complete as complete
from jaxstep.distributed.reports import read as read
from jaxstep.distributed.reports import root_cause as root_cause
from jaxstep.distributed.reports import write as write

__all__ = ["build", "complete", "read", "root_cause", "write"]

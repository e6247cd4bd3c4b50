"""The many-processes layer's face (the public one is :mod:`jaxstep.distributed`): the
``jax.distributed`` runtime, heartbeats, error reports and the launcher."""

from jaxstep._src.distributed import reports as reports
from jaxstep._src.distributed._failing import leave as leave
from jaxstep._src.distributed._failing import record as record
from jaxstep._src.distributed._failing import write_error_report as write_error_report
from jaxstep._src.distributed._heartbeats import PeerHeartbeats as PeerHeartbeats
from jaxstep._src.distributed._heartbeats import share_heartbeats as share_heartbeats
from jaxstep._src.distributed._runtime import DEFAULT_LOST_TIMEOUT as DEFAULT_LOST_TIMEOUT
from jaxstep._src.distributed._runtime import ENV_COORDINATOR as ENV_COORDINATOR
from jaxstep._src.distributed._runtime import ENV_LOST_TIMEOUT as ENV_LOST_TIMEOUT
from jaxstep._src.distributed._runtime import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxstep._src.distributed._runtime import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxstep._src.distributed._runtime import finish_in_flight as finish_in_flight
from jaxstep._src.distributed._runtime import initialize as initialize
from jaxstep._src.distributed._runtime import is_multiprocess as is_multiprocess
from jaxstep._src.distributed._runtime import log_stacks as log_stacks
from jaxstep._src.distributed._runtime import lost_after as lost_after
from jaxstep._src.distributed._runtime import lost_error as lost_error
from jaxstep._src.distributed._runtime import lost_processes as lost_processes
from jaxstep._src.distributed._runtime import monitor as monitor
from jaxstep._src.distributed._runtime import wait_ready as wait_ready
from jaxstep._src.distributed._runtime import watch as watch
from jaxstep._src.distributed.reports import root_cause as root_cause

__all__ = [
    "DEFAULT_LOST_TIMEOUT",
    "ENV_COORDINATOR",
    "ENV_LOST_TIMEOUT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "PeerHeartbeats",
    "finish_in_flight",
    "initialize",
    "is_multiprocess",
    "leave",
    "log_stacks",
    "lost_after",
    "lost_error",
    "lost_processes",
    "monitor",
    "record",
    "reports",
    "root_cause",
    "share_heartbeats",
    "wait_ready",
    "watch",
    "write_error_report",
]

"""Many processes, one run: ``jax.distributed`` set-up, which process feeds which rows,
host names, the peer heartbeats that name a lost process, error reports and the local
launcher (``python -m jaxstep.launch``). See docs/multihost.md.

Every process runs the same program; a step's devices span all of them, and each
process passes only the rows of the chunks whose devices it holds, in the step's
device order (:func:`~jaxstep.distributed.local_rows`). The health table is global, so every process
reaches the same verdict inside the step and raises the same error.
"""

from jaxstep._src.core.processes import host_name as host_name
from jaxstep._src.core.processes import local_batch as local_batch
from jaxstep._src.core.processes import local_positions as local_positions
from jaxstep._src.core.processes import local_rotation as local_rotation
from jaxstep._src.core.processes import local_rows as local_rows
from jaxstep._src.core.processes import local_rows_per_device as local_rows_per_device
from jaxstep._src.core.processes import place_local_batch as place_local_batch
from jaxstep._src.core.processes import process_pid as process_pid
from jaxstep._src.core.processes import share as share
from jaxstep._src.core.processes import spans_processes as spans_processes
from jaxstep._src.distributed import DEFAULT_LOST_TIMEOUT as DEFAULT_LOST_TIMEOUT
from jaxstep._src.distributed import ENV_COORDINATOR as ENV_COORDINATOR
from jaxstep._src.distributed import ENV_LOST_TIMEOUT as ENV_LOST_TIMEOUT
from jaxstep._src.distributed import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxstep._src.distributed import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxstep._src.distributed import PeerHeartbeats as PeerHeartbeats
from jaxstep._src.distributed import finish_in_flight as finish_in_flight
from jaxstep._src.distributed import initialize as initialize
from jaxstep._src.distributed import is_multiprocess as is_multiprocess
from jaxstep._src.distributed import leave as leave
from jaxstep._src.distributed import log_stacks as log_stacks
from jaxstep._src.distributed import lost_after as lost_after
from jaxstep._src.distributed import lost_error as lost_error
from jaxstep._src.distributed import lost_processes as lost_processes
from jaxstep._src.distributed import monitor as monitor
from jaxstep._src.distributed import record as record
from jaxstep._src.distributed import root_cause as root_cause
from jaxstep._src.distributed import share_heartbeats as share_heartbeats
from jaxstep._src.distributed import wait_ready as wait_ready
from jaxstep._src.distributed import watch as watch
from jaxstep._src.distributed import write_error_report as write_error_report
from jaxstep.distributed import reports as reports

__all__ = [
    "DEFAULT_LOST_TIMEOUT",
    "ENV_COORDINATOR",
    "ENV_LOST_TIMEOUT",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "PeerHeartbeats",
    "finish_in_flight",
    "host_name",
    "initialize",
    "is_multiprocess",
    "leave",
    "local_batch",
    "local_positions",
    "local_rotation",
    "local_rows",
    "local_rows_per_device",
    "log_stacks",
    "lost_after",
    "lost_error",
    "lost_processes",
    "monitor",
    "place_local_batch",
    "process_pid",
    "record",
    "reports",
    "root_cause",
    "share",
    "share_heartbeats",
    "spans_processes",
    "wait_ready",
    "watch",
    "write_error_report",
]

"""Testing kit: fake CPU devices, injected faults, corrupted replicas, and assertions
for users' own tests of their training code.

The pytest plugin (``jaxstep.testing.pytest``, loaded through its ``pytest11`` entry
point) gives every test session fake CPU devices and a ``jaxstep_backend`` fixture;
see ``docs/testing.md``.
"""

from jaxstep.program import Fault
from jaxstep.testing.assertions import assert_fails
from jaxstep.testing.assertions import assert_matches_reference
from jaxstep.testing.assertions import assert_replicas_equal
from jaxstep.testing.devices import set_cpu_devices
from jaxstep.testing.replica import corrupt_replica
from jaxstep.testing.replica import replicas
from jaxstep.testing.tiny import TinyStep
from jaxstep.testing.tiny import tiny_step

__all__ = [
    "Fault",
    "TinyStep",
    "assert_fails",
    "assert_matches_reference",
    "assert_replicas_equal",
    "corrupt_replica",
    "replicas",
    "set_cpu_devices",
    "tiny_step",
]

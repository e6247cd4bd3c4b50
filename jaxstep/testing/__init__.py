"""Testing kit: fake CPU devices, injected faults, corrupted replicas, and assertions
for users' own tests of their training code.

The pytest plugin (``jaxstep.testing.pytest``, loaded through its ``pytest11`` entry
point) gives every test session fake CPU devices and a ``jaxstep_backend`` fixture;
see ``docs/testing.md``.
"""

from jaxstep._src.program import Fault as Fault
from jaxstep._src.testing import TinyStep as TinyStep
from jaxstep._src.testing import assert_fails as assert_fails
from jaxstep._src.testing import assert_matches_reference as assert_matches_reference
from jaxstep._src.testing import assert_replicas_equal as assert_replicas_equal
from jaxstep._src.testing import corrupt_replica as corrupt_replica
from jaxstep._src.testing import replicas as replicas
from jaxstep._src.testing import set_cpu_devices as set_cpu_devices
from jaxstep._src.testing import tiny_step as tiny_step

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

"""The testing kit's layer (the public face is :mod:`jaxstep.testing`)."""

from jaxstep._src.testing.assertions import assert_fails as assert_fails
from jaxstep._src.testing.assertions import assert_matches_reference as assert_matches_reference
from jaxstep._src.testing.assertions import assert_replicas_equal as assert_replicas_equal
from jaxstep._src.testing.devices import set_cpu_devices as set_cpu_devices
from jaxstep._src.testing.replica import corrupt_replica as corrupt_replica
from jaxstep._src.testing.replica import replicas as replicas
from jaxstep._src.testing.tiny import TinyStep as TinyStep
from jaxstep._src.testing.tiny import tiny_step as tiny_step

__all__ = [
    "TinyStep",
    "assert_fails",
    "assert_matches_reference",
    "assert_replicas_equal",
    "corrupt_replica",
    "replicas",
    "set_cpu_devices",
    "tiny_step",
]

"""The traced per-device program: each device's own part (loss, gradients, checks)
before the one all-reduce, the verdict every device agrees on, and the guarded update.
Pure functions of the frozen :class:`Options` the step was built with (checked there,
once); nothing here touches the host."""

from jaxstep.program._body import body as body
from jaxstep.program._cross_checks import DEFAULT_DIVERGENCE_EVERY as DEFAULT_DIVERGENCE_EVERY
from jaxstep.program._cross_checks import LossSpike as LossSpike
from jaxstep.program._cross_checks import fingerprint as fingerprint
from jaxstep.program._device import example_failed as example_failed
from jaxstep.program._device import grad_leaves_finite as grad_leaves_finite
from jaxstep.program._drop import memory as drop_memory
from jaxstep.program._faults import Fault as Fault
from jaxstep.program._faults import Injector as Injector
from jaxstep.program._faults import float_leaves as float_leaves
from jaxstep.program._options import AXIS as AXIS
from jaxstep.program._options import Options as Options
from jaxstep.program._scaling import DynamicLossScale as DynamicLossScale

__all__ = [
    "AXIS",
    "DEFAULT_DIVERGENCE_EVERY",
    "DynamicLossScale",
    "Fault",
    "Injector",
    "LossSpike",
    "Options",
    "body",
    "drop_memory",
    "example_failed",
    "fingerprint",
    "float_leaves",
    "grad_leaves_finite",
]

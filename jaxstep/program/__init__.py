"""The traced per-device program: each device's own part (loss, gradients, checks)
before the one all-reduce, the verdict every device agrees on, and the guarded update.
Pure functions of a frozen :class:`Program`; nothing here touches the host."""

from jaxstep.program._across import DEFAULT_DIVERGENCE_EVERY as DEFAULT_DIVERGENCE_EVERY
from jaxstep.program._across import LossSpike as LossSpike
from jaxstep.program._body import body as body
from jaxstep.program._device import Program as Program
from jaxstep.program._faults import Fault as Fault
from jaxstep.program._faults import Injector as Injector
from jaxstep.program._faults import float_leaves as float_leaves
from jaxstep.program._scaling import DynamicLossScale as DynamicLossScale

__all__ = [
    "DEFAULT_DIVERGENCE_EVERY",
    "DynamicLossScale",
    "Fault",
    "Injector",
    "LossSpike",
    "Program",
    "body",
    "float_leaves",
]

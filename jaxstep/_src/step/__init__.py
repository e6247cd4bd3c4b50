"""The host driver of one step: :func:`make_train_step` gathers the options into one
checked :class:`~jaxstep._src.program.Options` and builds a :class:`TrainStep`, the public
face over a :class:`Runtime` (one set of devices: the backend, the compiled programs,
the input checks, the caches), which validates each batch, places it and dispatches
the compiled program (:mod:`jaxstep._src.program`) without waiting. A step is a value:
leaving devices out makes a new one (``TrainStep.without_devices``). The layers above
reach a step's runtime through :func:`runtime_of`; :func:`adopt` moves the step object
a user holds onto a new step (``exclude_devices``, and ``fit`` after a recovery left a
device out)."""

from jaxstep._src.step._build import make_train_step as make_train_step
from jaxstep._src.step._inputs import join_presplit as join_presplit
from jaxstep._src.step._runtime import Runtime as Runtime
from jaxstep._src.step._train_step import MOVED as MOVED
from jaxstep._src.step._train_step import TrainStep as TrainStep
from jaxstep._src.step._train_step import adopt as adopt
from jaxstep._src.step._train_step import runtime_of as runtime_of

__all__ = [
    "MOVED",
    "Runtime",
    "TrainStep",
    "adopt",
    "join_presplit",
    "make_train_step",
    "runtime_of",
]

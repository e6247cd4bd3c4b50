"""The host driver of one step: :func:`make_train_step` gathers the options into one
checked :class:`~jaxstep.program.Options` and builds a :class:`TrainStep` from it, which
validates each batch, places it and dispatches the compiled program
(:mod:`jaxstep.program`) without waiting. :mod:`jaxstep.step.driving` holds what the
other layers do with a step beyond its face (the loop's dispatch, reads of one
device's copy, the replay diagnosis, the dropping rerun)."""

from jaxstep.step._build import make_train_step as make_train_step
from jaxstep.step._inputs import join_presplit as join_presplit
from jaxstep.step._train_step import TrainStep as TrainStep

__all__ = ["TrainStep", "join_presplit", "make_train_step"]

"""The host driver of one step: :func:`make_train_step` gathers the options into one
checked :class:`~jaxstep.program.Options` and builds a :class:`TrainStep` from it, which
validates each batch, places it, dispatches the compiled program
(:mod:`jaxstep.program`) without waiting, and replays steps for diagnosis."""

from jaxstep.step._build import make_train_step as make_train_step
from jaxstep.step._inputs import join_presplit as join_presplit
from jaxstep.step._train_step import TrainStep as TrainStep

__all__ = ["TrainStep", "join_presplit", "make_train_step"]

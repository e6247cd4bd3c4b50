"""The traced per-device program: each device's own part (loss, gradients, checks)
before the one reduction, the verdict every device agrees on, and the guarded update:
one body (:class:`Step`) over a layout of the state and a failure policy, both picked
once from the frozen :class:`Options` the step was built with (checked there, once);
nothing here touches the host."""

from jaxstep._src.program._body import Step as Step
from jaxstep._src.program._cross_checks import DEFAULT_DIVERGENCE_EVERY as DEFAULT_DIVERGENCE_EVERY
from jaxstep._src.program._cross_checks import LossSpike as LossSpike
from jaxstep._src.program._cross_checks import all_agree as all_agree
from jaxstep._src.program._cross_checks import fingerprint as fingerprint
from jaxstep._src.program._cross_checks import minority as minority
from jaxstep._src.program._device import example_failed as example_failed
from jaxstep._src.program._device import grad_leaves_finite as grad_leaves_finite
from jaxstep._src.program._drop import drop_memory as drop_memory
from jaxstep._src.program._faults import Fault as Fault
from jaxstep._src.program._faults import Injector as Injector
from jaxstep._src.program._faults import float_leaves as float_leaves
from jaxstep._src.program._grid import Grid as Grid
from jaxstep._src.program._model import chips_inside as chips_inside
from jaxstep._src.program._model import merged as merged
from jaxstep._src.program._model import model_shardings as model_shardings
from jaxstep._src.program._model import model_specs as model_specs
from jaxstep._src.program._model import unit_prints as unit_prints
from jaxstep._src.program._model_dims import global_dims as global_dims
from jaxstep._src.program._model_dims import model_dims as model_dims
from jaxstep._src.program._model_dims import model_dims_of as model_dims_of
from jaxstep._src.program._options import AXIS as AXIS
from jaxstep._src.program._options import MODEL_AXIS as MODEL_AXIS
from jaxstep._src.program._options import ModelRule as ModelRule
from jaxstep._src.program._options import Options as Options
from jaxstep._src.program._padding import Kept as Kept
from jaxstep._src.program._padding import Pads as Pads
from jaxstep._src.program._padding import cut as cut
from jaxstep._src.program._padding import pad_to as pad_to
from jaxstep._src.program._scaling import DynamicLossScale as DynamicLossScale
from jaxstep._src.program._sharded import shard_mask as shard_mask
from jaxstep._src.program._shards import DEFAULT_SHARD_MIN_SIZE as DEFAULT_SHARD_MIN_SIZE
from jaxstep._src.program._shards import Plan as Plan
from jaxstep._src.program._shards import ShardRule as ShardRule
from jaxstep._src.program._shards import nbytes_per_device as nbytes_per_device
from jaxstep._src.program._shards import padding_of as padding_of
from jaxstep._src.program._shards import shard_axis as shard_axis
from jaxstep._src.program._shards import shard_spec as shard_spec

__all__ = [
    "AXIS",
    "DEFAULT_DIVERGENCE_EVERY",
    "DEFAULT_SHARD_MIN_SIZE",
    "DynamicLossScale",
    "Fault",
    "Grid",
    "Injector",
    "Kept",
    "LossSpike",
    "MODEL_AXIS",
    "ModelRule",
    "Options",
    "Pads",
    "Plan",
    "ShardRule",
    "Step",
    "all_agree",
    "chips_inside",
    "cut",
    "drop_memory",
    "example_failed",
    "fingerprint",
    "float_leaves",
    "global_dims",
    "grad_leaves_finite",
    "merged",
    "minority",
    "model_dims",
    "model_dims_of",
    "model_shardings",
    "model_specs",
    "nbytes_per_device",
    "pad_to",
    "padding_of",
    "shard_axis",
    "shard_mask",
    "shard_spec",
    "unit_prints",
]

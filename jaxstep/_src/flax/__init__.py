"""The Flax adapters' layer (the public face is :mod:`jaxstep.flax`)."""

from jaxstep._src.flax._linen import linen_apply as linen_apply
from jaxstep._src.flax._linen import linen_merge as linen_merge
from jaxstep._src.flax._linen import linen_split as linen_split
from jaxstep._src.flax._nnx import NNXGraph as NNXGraph
from jaxstep._src.flax._nnx import nnx_loss_fn as nnx_loss_fn
from jaxstep._src.flax._nnx import nnx_merge as nnx_merge
from jaxstep._src.flax._nnx import nnx_split as nnx_split
from jaxstep._src.flax._partitioning import model_rule as model_rule
from jaxstep._src.flax._partitioning import shard_rule as shard_rule

__all__ = [
    "NNXGraph",
    "linen_apply",
    "linen_merge",
    "linen_split",
    "model_rule",
    "nnx_loss_fn",
    "nnx_merge",
    "nnx_split",
    "shard_rule",
]

"""What a saved pytree looks like (:class:`Layout`) and the one-replica device copy a
checkpoint is written from (:func:`local_copy`)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import pickle
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstep._src.checkpoint import _blocks as blocks
from jaxstep._src.program import Pads


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a saved pytree looks like: leaf names (``keystr``), shapes and dtypes as one
    device holds them, the PRNG implementation of key leaves, and its tree structure."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    keys: dict[int, str]
    treedef: Any

    @classmethod
    def of(cls, tree: Any, *, stacked: bool = False, pads: Pads = None) -> Layout:
        """``tree``'s layout (``stacked``: leaves carry pmap's device axis; ``pads``: the
        leaves a layout holds padded, recorded with their logical shapes)."""
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [x for _, x in with_paths]
        shapes = [tuple(np.shape(x))[1 if stacked else 0 :] for x in leaves]
        for i, p in enumerate(pads or ()):
            if p is not None:
                axis, (length, _) = p
                shapes[i] = (*shapes[i][:axis], length, *shapes[i][axis + 1 :])
        return cls(
            names=tuple(jax.tree_util.keystr(p) for p, _ in with_paths),
            shapes=tuple(shapes),
            dtypes=tuple(str(x.dtype) for x in leaves),
            keys={i: str(jax.random.key_impl(x)) for i, x in enumerate(leaves) if _is_key(x)},
            treedef=treedef,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "keys": {str(i): impl for i, impl in self.keys.items()},
            "treedef": base64.b64encode(pickle.dumps(self.treedef)).decode("ascii"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        try:
            treedef = pickle.loads(base64.b64decode(data["treedef"]))
        except Exception as err:  # a class it names was renamed or removed
            treedef = err
        return cls(
            names=tuple(data["names"]),
            shapes=tuple(tuple(s) for s in data["shapes"]),
            dtypes=tuple(data["dtypes"]),
            keys={int(i): impl for i, impl in data["keys"].items()},
            treedef=treedef,
        )

    def build(self, leaves: Sequence[Any], treedef: Any = None) -> Any:
        """The tree from host leaves (key data wrapped back into typed keys)."""
        treedef = self.treedef if treedef is None else treedef
        if isinstance(treedef, Exception):
            raise ValueError(
                f"cannot rebuild the saved tree structure ({treedef}); restore it through "
                "fit(..., resume=True) with a state of the same structure"
            )
        leaves = [
            jax.random.wrap_key_data(jnp.asarray(x), impl=self.keys[i]) if i in self.keys else x
            for i, x in enumerate(leaves)
        ]
        return jax.tree.unflatten(treedef, leaves)


@functools.partial(jax.jit, static_argnums=1)
def _copy(leaves: list[jax.Array], stacked: bool) -> list[jax.Array]:
    out = []
    for x in leaves:
        x = x[0] if stacked else x
        out.append(jax.random.key_data(x) if _is_key(x) else jnp.copy(x))
    return out


def local_copy(tree: Any, *, stacked: bool) -> list[jax.Array]:
    """A fresh copy of the first local device's replica of every leaf, on that device
    (PRNG keys as key data; ``stacked``: leaves carry pmap's device axis); a leaf
    sharded over the devices (``shard_state``) copied whole, as the global array it is
    (:mod:`jaxstep._src.checkpoint._blocks`). Dispatched, not waited for, and unaffected by a
    later donation of ``tree``."""
    return blocks.local_copies(tree, stacked, _copy)

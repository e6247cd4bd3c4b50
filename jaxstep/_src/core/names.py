"""How jaxstep names a leaf: ``jax.tree_util.keystr`` of its path (``['dense1']['kernel']``),
leaving out the ``.value`` of a box (Flax's ``Partitioned``, ``LogicallyPartitioned``):
the leaf named is the boxed array. Errors, faults and the testing kit all use it."""

from __future__ import annotations

from typing import Any

import jax


def leaf_name(path: Any, prefix: str = "") -> str:
    """The name of the leaf at ``path`` (a key path from ``tree_leaves_with_path``)."""
    return prefix + jax.tree_util.keystr(tuple(k for k in path if not _is_box(k)))


def keystrs(tree: Any, prefix: str = "") -> list[str]:
    """The names of every leaf of ``tree``, in leaf order."""
    return [leaf_name(p, prefix) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _is_box(key: Any) -> bool:
    return isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value"


def without_root(leaf: str | None, root: str) -> str | None:
    """``leaf`` without ``root`` in front (``"params['w']"`` -> ``"['w']"``): the name of a
    leaf of that tree written either way. Others pass unchanged."""
    if leaf is not None and leaf.startswith(root) and leaf[len(root) : len(root) + 1] in ("[", "."):
        return leaf[len(root) :]
    return leaf

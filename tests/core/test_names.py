"""How a leaf is named, and its two spellings."""

import pytest

from jaxstep._src.core.names import without_root


@pytest.mark.parametrize(
    "leaf,want",
    [
        ("params['w']", "['w']"),
        ("params.w", ".w"),
        ("['w']", "['w']"),
        ("params", "params"),  # the whole tree, not a leaf of it: kept as written
        ("paramsx['w']", "paramsx['w']"),
        ("opt_state[0].mu['w']", "opt_state[0].mu['w']"),
        (None, None),
    ],
)
def test_without_root_takes_only_the_root_off_a_leaf_name(leaf, want):
    assert without_root(leaf, "params") == want

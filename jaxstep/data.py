"""Small real data for the demo and the notebooks: scikit-learn's bundled digits
(nothing downloaded), served as global batches that are the same whenever batch ``i``
is made. Made by :mod:`jaxstep.cli` for the demo; this is its public home."""

from jaxstep.cli.data import Split as Split
from jaxstep.cli.data import batches as batches
from jaxstep.cli.data import digits as digits

__all__ = ["Split", "batches", "digits"]

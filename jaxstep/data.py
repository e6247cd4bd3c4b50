"""Small real data for the demo and the notebooks: scikit-learn's bundled digits
(1797 8x8 images, shipped with the package, nothing downloaded), split once, then
served as global batches that are the same whenever batch ``i`` is made."""

from jaxstep._src.data import Split as Split
from jaxstep._src.data import batches as batches
from jaxstep._src.data import digits as digits

__all__ = [
    "Split",
    "batches",
    "digits",
]

"""What watches a run from outside the loop, reading its :class:`jaxstep.History`: the
progress line and the metric writers (JSONL, TensorBoard, CLU). The pictures of a run
are :mod:`jaxstep.plot`."""

from jaxstep._src.callbacks._clu import CluWriter as CluWriter
from jaxstep._src.callbacks._metrics import JsonlWriter as JsonlWriter
from jaxstep._src.callbacks._metrics import TensorBoardWriter as TensorBoardWriter
from jaxstep._src.callbacks._progress import Progress as Progress

__all__ = ["CluWriter", "JsonlWriter", "Progress", "TensorBoardWriter"]

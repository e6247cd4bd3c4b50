"""What watches a run from outside the loop, reading its :class:`jaxstep.History`: the
progress line, the metric writers (JSONL, TensorBoard, CLU) and the plots (public home:
:mod:`jaxstep.plot`)."""

from jaxstep.callbacks._clu import CluWriter as CluWriter
from jaxstep.callbacks._metrics import JsonlWriter as JsonlWriter
from jaxstep.callbacks._metrics import TensorBoardWriter as TensorBoardWriter
from jaxstep.callbacks._progress import Progress as Progress
from jaxstep.callbacks.plot import grad_norm_heatmap as grad_norm_heatmap
from jaxstep.callbacks.plot import loss_curves as loss_curves
from jaxstep.callbacks.plot import marks as marks
from jaxstep.callbacks.plot import overview as overview

__all__ = [
    "CluWriter",
    "JsonlWriter",
    "Progress",
    "TensorBoardWriter",
    "grad_norm_heatmap",
    "loss_curves",
    "marks",
    "overview",
]

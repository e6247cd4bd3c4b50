"""Pictures of a run from its :class:`jaxstep.History` (matplotlib): a device x step
heatmap of gradient norms with failures, skipped steps and overflows marked, and the
loss curve of every device with the recoveries of ``fit(..., recover=...)`` marked,
and where the job's time went (``goodput``).

    fig = jaxstep.plot.overview(history, "run.png")
"""

from jaxstep._src.plot import COLORBAR_LABEL as COLORBAR_LABEL
from jaxstep._src.plot import FAILURE_COLOR as FAILURE_COLOR
from jaxstep._src.plot import GOODPUT_COLORS as GOODPUT_COLORS
from jaxstep._src.plot import OVERFLOW_COLOR as OVERFLOW_COLOR
from jaxstep._src.plot import RECOVERY_COLOR as RECOVERY_COLOR
from jaxstep._src.plot import goodput as goodput
from jaxstep._src.plot import grad_norm_heatmap as grad_norm_heatmap
from jaxstep._src.plot import loss_curves as loss_curves
from jaxstep._src.plot import marks as marks
from jaxstep._src.plot import overview as overview

__all__ = [
    "COLORBAR_LABEL",
    "FAILURE_COLOR",
    "GOODPUT_COLORS",
    "OVERFLOW_COLOR",
    "RECOVERY_COLOR",
    "goodput",
    "grad_norm_heatmap",
    "loss_curves",
    "marks",
    "overview",
]

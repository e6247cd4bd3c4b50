"""How jaxstep speaks outside its errors: its log lines (:data:`log`, the ``"jaxstep"``
logger) and its warnings (:func:`warn`, pointed at the user's line).

jaxstep leaves logging to the application, as the standard library's logging HOWTO asks
of a library: it adds no handler and never turns propagation off, so the lines go
wherever the application's set-up sends them (absl's, a notebook's, a cluster's
collector), at the levels it chose. With no set-up at all, warnings and errors still
reach stderr, as the bare message, through logging's last-resort handler: a notebook
shows them without a line of configuration. To see jaxstep's INFO lines (a resume, a
recovery a progress bar already shows): ``logging.getLogger("jaxstep").setLevel(logging.INFO)``
and a handler of your own (``logging.basicConfig(level=logging.INFO)``)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

#: jaxstep's logger; its records propagate to the application's handlers
log = logging.getLogger("jaxstep")

#: the folder of the jaxstep package (three up from jaxstep/_src/core/): frames there
#: are jaxstep's own
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the user's line: the first frame of the caller's
    stack outside jaxstep (so the line Python prints under the warning is the user's
    call, and a filter on the user's module catches it)."""
    frame = sys._getframe(1)
    level = 2  # 1 is this function's own frame; 2 its caller's
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)

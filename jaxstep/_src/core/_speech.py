"""How jaxstep speaks outside its errors: its log lines (:data:`log`, the ``"jaxstep"``
logger, with a handler of its own) and its warnings (:func:`warn`, pointed at the
user's line).

The log lines go to stderr as the message alone, whatever else configured Python's
logging: before, they came through logging's last-resort handler as the bare message
until some library (orbax's, through absl) configured the root logger, and from then
on as ``WARNING:jaxstep:...``. To send them through your own logging set-up instead:
``logging.getLogger("jaxstep").propagate = True`` and remove its handler."""

from __future__ import annotations

import logging
import os
import sys
import warnings

#: jaxstep's logger: warnings and above to stderr, as the message alone
log = logging.getLogger("jaxstep")
if not any(getattr(h, "jaxstep", False) for h in log.handlers):
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    _handler.jaxstep = True  # type: ignore[attr-defined]  # (a re-import adds no second)
    log.addHandler(_handler)
    log.propagate = False

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

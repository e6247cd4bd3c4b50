"""jaxstep's internals: the layers, bottom to top (docs/internals.md). Users import
``jaxstep`` and its public modules (``jaxstep.testing``, ``.flax``, ``.distributed``,
``.plot``, ``.data``, ``.launch``); nothing under ``_src`` is public.

Until 0.2.0 the layers were ``jaxstep.loop``, ``jaxstep.step``, ... beside the public
modules. Those paths still import for one release (the same modules, with a
``DeprecationWarning`` naming where to go instead), and go in 0.3.0."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: The layers that stood beside the public modules before 0.2.0 (``jaxstep.loop``, ...).
MOVED = ("callbacks", "checkpoint", "cli", "core", "loop", "program", "step")


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import jaxstep.loop`` (or ``jaxstep.loop._fit``): the module now under
    ``jaxstep._src``, with a warning."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parts = fullname.split(".")
        if len(parts) > 1 and parts[0] == "jaxstep" and parts[1] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = "jaxstep._src." + spec.name.removeprefix("jaxstep.")
        warnings.warn(
            f"{spec.name} is internal and moved to {new} in jaxstep 0.2.0; import jaxstep "
            "(or jaxstep.testing, .flax, .distributed, .plot, .data) and use its public "
            f"names instead: the path {spec.name} goes in 0.3.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name."""


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Moved())  # before an old install of jaxstep that has them

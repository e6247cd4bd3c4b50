"""Fails the build when a public name has no entry in the API reference.

optax checks its reference with a builder of its own (``docs/ext/coverage_check.py``;
chex has ``make coverage_check``); here the check runs in every build, once every page
is read: each name a user can reach must be an object of the Python domain, or the
build stops listing those missing. The public names are each public module's
``__all__`` (:data:`PUBLIC_MODULES`) and, for each public class defined in jaxstep,
its public members: methods, properties, dataclass and NamedTuple fields, enum
members. An entry whose name has a private part (``jaxstep.step._build.x``) fails the
build too: the reference never sends a user to an internal module.

``python docs/ext/coverage_check.py`` prints the names the check requires.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from sphinx.errors import SphinxError
from sphinx.util import logging

PACKAGE = "jaxstep"
#: the modules whose ``__all__`` is public, each with a page in docs/api/
PUBLIC_MODULES = (
    "jaxstep",
    "jaxstep.testing",
    "jaxstep.flax",
    "jaxstep.distributed",
    "jaxstep.distributed.reports",
    "jaxstep.plot",
    "jaxstep.data",
    "jaxstep.launch",
)


class CoverageCheckFailed(SphinxError):
    category = "Coverage check failed"


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` is defined in jaxstep (not re-exported from elsewhere)."""
    module = getattr(obj, "__module__", None) or ""
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def class_members(cls: type) -> list[str]:
    """The public members of a class defined in jaxstep: those defined on it or on a
    jaxstep base (not ``object``'s, ``tuple``'s or ``Exception``'s), its dataclass
    and NamedTuple fields, and its enum members."""
    names: set[str] = set()
    for base in cls.__mro__:
        if is_ours(base):
            names.update(vars(base))
    if dataclasses.is_dataclass(cls):
        names.update(f.name for f in dataclasses.fields(cls))
    if issubclass(cls, tuple):
        names.update(getattr(cls, "_fields", ()))
    if issubclass(cls, enum.Enum):
        names.update(cls.__members__)
    return sorted(n for n in names if not n.startswith("_"))


def module_names(module: Any) -> list[str]:
    """A public module's public names: its ``__all__``."""
    names = getattr(module, "__all__", None)
    if names is None:
        raise CoverageCheckFailed(f"{module.__name__} has no __all__: its public names are unknown")
    return list(names)


def public_names(modules: Iterable[str] = PUBLIC_MODULES) -> Iterator[str]:
    """Every full name the reference must hold: each module, each name of its
    ``__all__`` (a submodule is one of ``modules``) and each public class's members."""
    for modname in modules:
        module = importlib.import_module(modname)
        yield modname
        for name in module_names(module):
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            full = f"{modname}.{name}"
            yield full
            if inspect.isclass(obj) and is_ours(obj):
                yield from (f"{full}.{member}" for member in class_members(obj))


def private_entries(documented: Iterable[str]) -> list[str]:
    """Entries that name a private module or member (``jaxstep.loop._fit.fit``);
    dunders (``TrainStep.__call__``) are public."""

    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    return sorted(
        n for n in documented if n.split(".")[0] == PACKAGE and any(map(private, n.split(".")))
    )


def problems(required: Iterable[str], documented: set[str], excused: dict[str, str]) -> list[str]:
    """What fails the check, one line a name (empty: the reference is whole)."""
    required = list(required)
    lost = sorted(set(required) - documented - set(excused))
    stale = sorted(set(excused) - set(required))
    done = sorted(set(excused) & documented)
    return (
        [f"{n} is public and has no entry in the API reference (docs/api/)" for n in lost]
        + [
            f"{n} has an entry but names a private module or member"
            for n in private_entries(documented)
        ]
        + [f"{n} is in conf.py's coverage_ignore but is not public" for n in stale]
        + [f"{n} is in conf.py's coverage_ignore but has an entry now: take it out" for n in done]
    )


def _check(app: Any, env: Any) -> None:
    log = logging.getLogger(__name__)
    domain = env.domains["py"]
    # Aliases (autodoc's ``:canonical:`` names, where a class is defined) are no entries.
    documented = {n for n, e in domain.objects.items() if not e.aliased} | set(domain.modules)
    required = list(public_names(app.config.coverage_modules))
    excused = dict(app.config.coverage_ignore)
    found = problems(required, documented, excused)
    for line in found:
        log.warning(f"coverage check: {line}", type="coverage")
    for name, why in sorted(excused.items()):
        log.info(f"coverage check: {name} excused: {why}")
    if found:
        app.statuscode = 1  # fails the build with or without -W
    else:
        log.info(
            f"coverage check: {len(required) - len(excused)} of {len(required)} public names "
            "have an entry in the reference"
        )


def setup(app: Any) -> dict[str, Any]:
    app.add_config_value("coverage_modules", list(PUBLIC_MODULES), "env")
    #: name -> why it has no entry yet (each is printed by every build)
    app.add_config_value("coverage_ignore", {}, "env")
    app.connect("env-check-consistency", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for full in public_names():
        print(full)

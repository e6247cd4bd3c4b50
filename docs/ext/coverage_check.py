"""Fails the build when a public name has no entry in the API reference, or a docstring
that does not say what it takes and gives.

optax checks its reference with a builder of its own (``docs/ext/coverage_check.py``;
chex has ``make coverage_check``); here the check runs in every build, once every page
is written: each name a user can reach must be an object of the Python domain, or the
build fails listing those missing. The public names are each public module's
``__all__`` (:data:`PUBLIC_MODULES`) and, for each public class defined in jaxstep,
its public members: methods, properties, dataclass and NamedTuple fields, enum
members. Each public function, method and class must describe every argument it takes
(Google style: Args, or Attributes for a class's fields) and, when it returns
something, what (Returns, or Yields). A public value of a builtin type (an ``int``,
a ``str``) is described by the ``#:`` comment above the assignment that defines it
(:func:`own_words` hands it to autodoc, which reads such comments only in the module
an entry names: a face, where the value is only imported); one that has none would
show Python's docstring of ``int`` or ``str`` as its own, in its entry and in its
summary, and fails the build. Each public function and class (a name of a public
module's ``__all__``) shows how it is used: its docstring has an example (an
``Example`` section, Google style, with ``>>>`` lines that the test suite runs as
doctests; a ``::`` code block only where nothing can run in one process), or the build
fails. An entry whose name has a private part
(``jaxstep._src.step._build.x``) fails the build too: the reference never sends a user to an
internal module.

``python docs/ext/coverage_check.py`` prints the names the check requires.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from sphinx.errors import PycodeError
from sphinx.errors import SphinxError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docstrings import prepare_docstring

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


def public_objects(modules: Iterable[str] = PUBLIC_MODULES) -> Iterator[tuple[str, Any]]:
    """Every full name the reference must hold, with what it names: each module, each
    name of its ``__all__`` (a submodule is one of ``modules``) and each public class's
    members (as the class holds them: a property, a function; None for a field)."""
    for modname in modules:
        module = importlib.import_module(modname)
        yield modname, module
        for name in module_names(module):
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            full = f"{modname}.{name}"
            yield full, obj
            if inspect.isclass(obj) and is_ours(obj):
                for member in class_members(obj):
                    raw = next((vars(c)[member] for c in obj.__mro__ if member in vars(c)), None)
                    yield f"{full}.{member}", raw


def public_names(modules: Iterable[str] = PUBLIC_MODULES) -> Iterator[str]:
    """Every full name the reference must hold (:func:`public_objects`' names)."""
    return (full for full, _ in public_objects(modules))


def _documented_parameters(doc: str) -> tuple[set[str], bool]:
    """The names a Google-style docstring describes (under Args, or Attributes for a
    class's fields) and whether it says what comes back (Returns or Yields)."""
    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    config = Config(napoleon_use_param=True, napoleon_use_rtype=False, napoleon_use_ivar=False)
    names, returns = set(), False
    for line in str(GoogleDocstring(doc, config, what="function")).splitlines():
        if line.startswith(":param "):
            for name in line[len(":param ") :].split(":")[0].split(","):
                names.add(name.strip().replace("\\", "").lstrip("*").split()[-1])
        elif line.startswith(".. attribute:: "):
            names.add(line.split("::", 1)[1].strip())
        elif line.startswith((":returns:", ":Yields:")):
            returns = True
    return names, returns


def unsaid(obj: Any) -> list[str]:
    """What a public function's, method's or class's docstring leaves unsaid: each
    parameter it takes that no Args (or, for a class, Attributes) entry describes, and
    what it returns when it returns something (Returns, or Yields). Only callables
    defined in jaxstep are read; properties and enums are their entries alone."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if not callable(obj) or not is_ours(obj) or isinstance(obj, property):
        return []
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return []
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    names, returns = _documented_parameters(inspect.getdoc(obj) or "")
    out = [
        f"argument {p.name!r}"
        for p in signature.parameters.values()
        if p.name not in ("self", "cls") and p.name not in names
    ]
    gives = signature.return_annotation
    silent = gives in (signature.empty, None, "None", "NoReturn")
    if not inspect.isclass(obj) and not silent and not returns:
        out.append("what it returns")
    return out


def borrowed_docstring(obj: Any) -> str | None:
    """The builtin type whose docstring ``obj`` would show as its own (``"int"`` for
    ``75``: autodoc reads a value's ``__doc__``, its type's), or None: a module, class
    or function has a docstring of its own, and a jaxstep type's is jaxstep's words."""
    if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj):
        return None
    kind = type(obj)
    doc = getattr(obj, "__doc__", None)
    if kind.__module__ != "builtins" or not doc or doc != kind.__doc__:
        return None
    return kind.__name__


def defining_comment(name: str, obj: Any) -> list[str]:
    """The ``#:`` comment above the assignment that defines the value ``obj`` bound
    to ``name`` in a jaxstep module (empty: none says what it is). The faces only
    import it, so the comment is where it is assigned."""
    short = name.rsplit(".", 1)[-1]
    for modname in sorted(sys.modules):
        if modname != PACKAGE and not modname.startswith(PACKAGE + "."):
            continue
        if vars(sys.modules[modname]).get(short, None) is not obj:
            continue
        try:
            analyzer = ModuleAnalyzer.for_module(modname)
            analyzer.analyze()
        except PycodeError:
            continue
        comment = analyzer.attr_docs.get(("", short))
        if comment:
            return list(comment)
    return []


def borrowed(required: dict[str, Any]) -> dict[str, str]:
    """The public module-level values (names of a public module's ``__all__``) whose
    entry would show a builtin's docstring, each with that builtin's name: no ``#:``
    comment where they are defined says what they are. (A class's fields are its
    docstring's Attributes, whatever their values' types.)"""
    out = {}
    for name, obj in required.items():
        parent = name.rsplit(".", 1)[0]
        if parent == name or not inspect.ismodule(required.get(parent)):
            continue
        builtin = borrowed_docstring(obj)
        if builtin is not None and not defining_comment(name, obj):
            out[name] = builtin
    return out


def has_example(obj: Any) -> bool:
    """Whether ``obj``'s own docstring (not one it inherits) shows how it is used:
    ``>>>`` lines, or an ``Example``/``Examples`` section (``Example:``, or
    ``Example::`` before a code block)."""
    doc = inspect.cleandoc(getattr(obj, "__doc__", None) or "")
    headings = {"Example:", "Examples:", "Example::", "Examples::"}
    return ">>>" in doc or any(line.strip() in headings for line in doc.splitlines())


def without_example(required: dict[str, Any]) -> list[str]:
    """The public functions and classes (names of a public module's ``__all__``,
    defined in jaxstep) whose docstring has no example (:func:`has_example`); a
    class's members and the public values are not asked for one."""
    out = []
    for name, obj in required.items():
        parent = name.rsplit(".", 1)[0]
        if parent == name or not inspect.ismodule(required.get(parent)):
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not is_ours(obj):
            continue
        if not has_example(obj):
            out.append(name)
    return sorted(out)


def own_words(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """autodoc-process-docstring: a public value's docstring is the ``#:`` comment
    where it is defined, not its builtin type's (which autodoc reads when the entry
    names a face that only imports the value); in its entry and in autosummary's
    summary alike."""
    builtin = borrowed_docstring(obj)
    if what != "data" or builtin is None:
        return
    theirs = prepare_docstring(type(obj).__doc__)
    if [line for line in lines if line] != [line for line in theirs if line]:
        return  # autodoc found words of the value's own
    comment = defining_comment(name, obj)
    if comment:
        lines[:] = comment


def private_entries(documented: Iterable[str]) -> list[str]:
    """Entries that name a private module or member (``jaxstep._src.loop._fit.fit``);
    dunders (``TrainStep.__call__``) are public."""

    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    return sorted(
        n for n in documented if n.split(".")[0] == PACKAGE and any(map(private, n.split(".")))
    )


def problems(required: dict[str, Any], documented: set[str], excused: dict[str, str]) -> list[str]:
    """What fails the check, one line a name (empty: the reference is whole).

    ``required``: the public names and what they name (:func:`public_objects`);
    ``excused``: names whose entry or docstring may be missing yet (conf.py's
    ``coverage_ignore``; an excuse no longer needed is a problem too, so none outlives
    its reason)."""
    lost = sorted(set(required) - documented - set(excused))
    gaps = {n: unsaid(obj) for n, obj in required.items()}
    vague = sorted(n for n, gap in gaps.items() if gap and n not in excused)
    lent = borrowed(required)
    bare = without_example(required)
    stale = sorted(set(excused) - set(required))
    # what an excuse may cover: each of the problems below but the stale and the private
    wanting = (set(required) - documented) | {n for n, gap in gaps.items() if gap}
    wanting |= set(lent) | set(bare)
    done = sorted(set(excused) & set(required) - wanting)
    return (
        [f"{n} is public and has no entry in the API reference (docs/api/)" for n in lost]
        + [f"{n}'s docstring does not say {', '.join(gaps[n])}" for n in vague]
        + [
            f"{n}'s entry shows Python's docstring of {lent[n]}: describe it in a #: comment "
            "above the assignment that defines it"
            for n in sorted(set(lent) - set(excused))
        ]
        + [
            f"{n} has no example in its docstring: add an Example section with >>> lines "
            "(run as a doctest; a :: code block only where nothing runs in one process)"
            for n in bare
            if n not in excused
        ]
        + [
            f"{n} has an entry but names a private module or member"
            for n in private_entries(documented)
        ]
        + [f"{n} is in conf.py's coverage_ignore but is not public" for n in stale]
        + [f"{n} is in conf.py's coverage_ignore but needs it no more: take it out" for n in done]
    )


def _check(app: Any, exception: BaseException | None) -> None:
    if exception is not None:
        return
    log = logging.getLogger(__name__)
    domain = app.env.domains["py"]
    # Aliases (autodoc's ``:canonical:`` names, where a class is defined) are no entries.
    documented = {n for n, e in domain.objects.items() if not e.aliased} | set(domain.modules)
    required = dict(public_objects(app.config.coverage_modules))
    excused = dict(app.config.coverage_ignore)
    found = problems(required, documented, excused)
    for line in found:
        log.warning(f"coverage check: {line}", type="coverage")
    for why in sorted(set(excused.values())):
        names = sorted(n for n, reason in excused.items() if reason == why)
        log.info(f"coverage check: {len(names)} excused ({why}): {', '.join(names)}")
    if found:
        app.statuscode = 1  # fails the build with or without -W
    else:
        log.info(
            f"coverage check: {len(required) - len(excused)} of {len(required)} public names "
            "have an entry in the reference and a docstring that says what they take and give "
            "(each function and class with an example)"
        )


def setup(app: Any) -> dict[str, Any]:
    app.add_config_value("coverage_modules", list(PUBLIC_MODULES), "env")
    #: name -> why it has no entry yet (each is printed by every build)
    app.add_config_value("coverage_ignore", {}, "env")
    # At the end of every build, incremental ones too (where Sphinx checks no
    # consistency when no page changed, though __all__ may have).
    app.connect("autodoc-process-docstring", own_words)
    app.connect("build-finished", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    for full in public_names():
        print(full)

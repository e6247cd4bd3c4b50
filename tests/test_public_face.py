"""The public face, name by name and signature by signature, against the committed
list in tests/public_face.txt: a change to what users import is made on purpose, with a
CHANGELOG line, never by the way.

The names are those the API reference must hold (docs/ext/coverage_check.py: each
public module's ``__all__`` and each public class's members). After a deliberate
change, write the list again with ``python tests/test_public_face.py``.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.util
import inspect
import pathlib
import re
import sys
import typing
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "public_face.txt"
HEADER = """\
# jaxstep's public face: every public name, with its signature (tests/test_public_face.py).
# A change here is a change users see. Make it on purpose, say it in CHANGELOG.md, and
# write this file again: python tests/test_public_face.py
"""


def _coverage_check() -> Any:
    """docs/ext/coverage_check.py: what the reference must hold is what this lists."""
    spec = importlib.util.spec_from_file_location(
        "coverage_check", ROOT / "docs" / "ext" / "coverage_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _default(value: Any) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))  # a sentinel's address varies


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, typing.ForwardRef):  # a NamedTuple's, under __future__
        return annotation.__forward_arg__
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def signature(obj: Any, *, method: bool = False) -> str:
    """``(a: int, *, b: str = 'x') -> bool``, stable from run to run (a method's
    without ``self``)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if method and params and params[0].name == "self":
        params = params[1:]
    parts, star = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY)
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {_default(p.default)}"
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return out


def _member(cls: type, name: str) -> str:
    """One line for a class member: a method's signature, a property's type, a field's
    annotation, an enum member's value."""
    if issubclass(cls, enum.Enum) and name in cls.__members__:
        return f" = {cls.__members__[name].value!r}"
    for base in cls.__mro__:
        if name in vars(base):
            raw = vars(base)[name]
            break
    else:  # a field with no default: only its annotation
        raw = None
    if isinstance(raw, property):
        hint = inspect.signature(raw.fget).return_annotation if raw.fget else None
        return " [property]" + ("" if hint in (None, inspect.Signature.empty) else f": {hint}")
    if isinstance(raw, (staticmethod, classmethod)):
        kind = type(raw).__name__
        return f" [{kind}]" + signature(getattr(cls, name))
    if callable(raw):
        return signature(raw, method=True)
    annotations: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        annotations.update(vars(base).get("__annotations__", {}))
    if name in annotations:  # a field
        return f": {_annotation(annotations[name])}"
    if hasattr(type(raw), "__get__"):  # a descriptor: an attribute read on instances
        return " [attribute]"
    return f" = {_default(raw)}"


def face() -> list[str]:
    """Every public name, one a line, in the reference's order (module by module)."""
    check = _coverage_check()
    lines = []
    for modname in check.PUBLIC_MODULES:
        module = importlib.import_module(modname)
        lines.append(f"module {modname}")
        for name in sorted(check.module_names(module)):
            obj = getattr(module, name)
            full = f"{modname}.{name}"
            if inspect.ismodule(obj):
                lines.append(f"{full} [module {obj.__name__}]")
            elif inspect.isclass(obj):
                bases = [b.__name__ for b in obj.__bases__ if b is not object]
                based = f" [{', '.join(bases)}]" if bases else ""
                made = "" if issubclass(obj, enum.Enum) else signature(obj)
                lines.append(f"class {full}{made}{based}")
                if check.is_ours(obj):
                    lines += [f"{full}.{m}{_member(obj, m)}" for m in check.class_members(obj)]
            elif callable(obj):
                lines.append(f"{full}{signature(obj)}")
            else:
                lines.append(f"{full} = {_default(obj)}")
    return lines


def test_the_public_face_is_the_committed_one():
    now = face()
    committed = [
        line for line in SNAPSHOT.read_text().splitlines() if line and not line.startswith("#")
    ]
    diff = "\n".join(
        difflib.unified_diff(committed, now, "tests/public_face.txt", "the package", lineterm="")
    )
    assert now == committed, (
        "the public face changed (- committed, + now):\n"
        f"{diff}\n"
        "If the change is deliberate, say it in CHANGELOG.md and write the list again: "
        "python tests/test_public_face.py"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    SNAPSHOT.write_text(HEADER + "\n" + "\n".join(face()) + "\n")
    print(f"wrote {SNAPSHOT.relative_to(ROOT)} ({len(face())} lines)")


def test_a_layer_that_moved_under_src_still_imports_with_a_warning_that_names_the_way():
    """``jaxstep.loop`` and the other layers moved to ``jaxstep._src`` in 0.2.0: the old
    path gives the same module for one release, and says where to go."""
    import warnings

    import jaxstep

    sys.modules.pop("jaxstep.checkpoint", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from jaxstep.checkpoint import read_emergency
    assert read_emergency is jaxstep.read_emergency
    assert sys.modules["jaxstep.checkpoint"] is importlib.import_module("jaxstep._src.checkpoint")
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert "jaxstep.checkpoint is internal and moved to jaxstep._src.checkpoint" in str(
        warning.message
    )
    assert "goes in 0.3.0" in str(warning.message)
    assert warning.filename == __file__  # pointed at the importing line

"""The package's folders keep the architecture docs/internals.md draws: each layer
imports only itself and the layers below it, no packages or modules import each
other in a circle (annotations under ``TYPE_CHECKING`` count: a circle they close is
still one the reader must hold in mind), functions stay short (a module is sized by
its concept, not by a count), each face lists exactly what it imports, a public thing
has one path, and no module reaches into another package's private modules.

Read from the source with :mod:`ast` (nothing of jaxstep is imported), so a broken
layer fails here by name, not as an import error somewhere else."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxstep"

#: Bottom to top; a module may import its own layer and any layer below it. The layers
#: are the folders (and two modules) of ``jaxstep/_src``. The pictures
#: (``_src/plot.py``) read a run's History like the callbacks; the users' kits (the
#: testing kit, the flax helpers, the digits data of ``_src/data.py``) sit on the
#: library's layers; the ``jaxstep`` command demos the testing kit (faults, fake
#: devices, a corrupted replica) on the digits, so it sits on them; the public faces
#: (everything outside ``_src``: ``jaxstep/__init__.py``, ``jaxstep.testing``, ...)
#: re-export from everything below.
ORDER = [
    ("core",),
    ("program",),
    ("step",),
    ("distributed",),
    ("checkpoint",),
    ("loop",),
    ("callbacks", "plot"),
    ("testing", "flax", "data"),
    ("cli",),
    ("faces",),
]
RANK = {package: rank for rank, packages in enumerate(ORDER) for package in packages}

#: The folder of the internals: every module under it belongs to a layer, every module
#: outside it is a public face.
SRC = "jaxstep._src"

#: A function longer than this (lines of code: docstring, blank and comment lines
#: left out) must say why in its docstring, with these words.
MAX_FUNCTION_LINES = 80
LONG_BECAUSE = "long because"


@dataclasses.dataclass(frozen=True)
class Import:
    """One ``import`` of a jaxstep module, where it stands in its module."""

    source: str  # the importing module, e.g. jaxstep._src.loop._fit
    target: str  # the module imported, e.g. jaxstep._src.core._state
    names: tuple[str, ...]  # for ``from target import a, b``: a, b
    line: int
    top_level: bool  # runs when the module is imported (not inside a function)
    type_checking: bool  # inside ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        names = f" ({', '.join(self.names)})" if self.names else ""
        return f"{path_of(self.source)}:{self.line}: {self.target}{names}"


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def path_of(module: str) -> str:
    return str(MODULES[module].relative_to(PACKAGE.parent))


def package_of(module: str) -> str:
    """The layer a module belongs to: its folder (or module) under ``jaxstep/_src``
    (``loop`` for jaxstep._src.loop._fit, ``plot`` for jaxstep._src.plot), and ``faces``
    for every module outside ``_src`` (and ``_src``'s own empty ``__init__``)."""
    parts = module.split(".")
    if module.startswith(SRC + ".") and len(parts) > 2:
        return parts[2]
    return "faces"


def is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(source: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports too)."""
    if not node.level:
        return node.module or ""
    base = source.split(".")
    base = base if is_package(source) else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports(source: str, text: str | None = None) -> Iterator[Import]:
    """Every import of a jaxstep module in ``source`` (or in ``text``, read as that
    module), at any depth."""
    tree = ast.parse(MODULES[source].read_text() if text is None else text)

    def visit(node: ast.AST, top_level: bool, type_checking: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxstep":
                    yield Import(source, alias.name, (), node.lineno, top_level, type_checking)
            return
        if isinstance(node, ast.ImportFrom):
            module = _resolve(source, node)
            if module.split(".")[0] != "jaxstep":
                return
            names = tuple(alias.name for alias in node.names)
            # ``from jaxstep.pkg import _mod`` imports the module jaxstep.pkg._mod.
            submodules = [n for n in names if f"{module}.{n}" in MODULES]
            for name in submodules:
                target = f"{module}.{name}"
                yield Import(source, target, (), node.lineno, top_level, type_checking)
            rest = tuple(n for n in names if n not in submodules)
            if rest:
                yield Import(source, module, rest, node.lineno, top_level, type_checking)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, top_level, True)
            for child in node.orelse:
                yield from visit(child, top_level, type_checking)
            return
        inner = top_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner, type_checking)

    yield from visit(tree, True, False)


IMPORTS = [i for module in MODULES for i in imports(module)]


def test_every_module_belongs_to_a_layer_of_the_order():
    """A new sub-package must be placed in ORDER (and in docs/internals.md): else the
    checks below would not see it."""
    packages = {package_of(m) for m in MODULES}
    assert packages <= set(RANK), f"not placed in the layer order: {packages - set(RANK)}"
    assert {"core", "program", "step", "loop", "faces"} <= packages  # the walk found them
    assert len(IMPORTS) > 100


def test_the_walk_finds_imports_in_functions_and_marks_type_checking_ones():
    text = (
        "from typing import TYPE_CHECKING\n"
        "from jaxstep._src.core import Status\n"
        "if TYPE_CHECKING:\n"
        "    from jaxstep._src.loop import History\n"
        "def f():\n"
        "    import jaxstep\n"
        "    from jaxstep import data\n"
        "    from . import _passes\n"
    )
    found = {
        (i.target, i.top_level, i.type_checking) for i in imports("jaxstep._src.step._build", text)
    }
    assert found == {
        ("jaxstep._src.core", True, False),
        ("jaxstep._src.loop", True, True),
        ("jaxstep", False, False),
        ("jaxstep.data", False, False),
        ("jaxstep._src.step._passes", False, False),
    }
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_go_to_the_same_or_a_lower_layer():
    """At module level, inside functions and under ``if TYPE_CHECKING:`` (an annotation
    that names a layer above ties the layers as surely as an import that runs)."""
    upward = [
        f"{i}  [{package_of(i.source)} imports {package_of(i.target)}]"
        for i in IMPORTS
        if RANK[package_of(i.target)] > RANK[package_of(i.source)]
    ]
    assert not upward, "imports of a layer above:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_packages_import_each_other_in_a_circle():
    """``if TYPE_CHECKING:`` imports included."""
    edges: dict[str, set[str]] = {}
    for i in IMPORTS:
        source, target = package_of(i.source), package_of(i.target)
        if source != target:
            edges.setdefault(source, set()).add(target)
    assert not _cycles(edges), f"packages in a circle: {_cycles(edges)}"


def test_no_modules_import_each_other_in_a_circle():
    """Module-level imports, ``if TYPE_CHECKING:`` ones included (an import inside a
    function runs only when it is called, and is left out)."""
    edges: dict[str, set[str]] = {}
    found: dict[tuple[str, str], Import] = {}
    for i in IMPORTS:
        if i.top_level and i.source != i.target:
            edges.setdefault(i.source, set()).add(i.target)
            found.setdefault((i.source, i.target), i)
    shown = [
        "\n".join(str(i) for (a, b), i in found.items() if a in circle and b in circle)
        for circle in _cycles(edges)
    ]
    assert not shown, "modules in a circle:\n" + "\n\n".join(shown)


def _lines_of_code(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    first = node.body[0]
    if ast.get_docstring(node) is not None:
        span -= set(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(1 for n in span if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def test_no_function_is_longer_than_80_lines_unless_its_docstring_says_why():
    long = []
    for module, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            count = _lines_of_code(node, lines)
            if count > MAX_FUNCTION_LINES and LONG_BECAUSE not in (ast.get_docstring(node) or ""):
                long.append(f"{path_of(module)}:{node.lineno}: {node.name} ({count} lines)")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines of code whose docstring does not say "
        f"why ('{LONG_BECAUSE} ...'):\n" + "\n".join(long)
    )


#: Every module that hands names on: the layers' faces (each ``__init__.py`` under
#: ``_src``) and the public faces (every module outside ``_src`` with an ``__all__``);
#: jaxstep/__init__.py groups its names by subject and also reaches jaxstep.flax lazily.
FACES = [m for m in MODULES if is_package(m) and m not in ("jaxstep", SRC)] + [
    m
    for m in MODULES
    if package_of(m) == "faces" and not is_package(m) and "__all__" in MODULES[m].read_text()
]


@pytest.mark.parametrize("face", FACES, ids=path_of)
def test_a_face_lists_in_all_sorted_exactly_the_names_it_imports(face):
    """Of jaxstep's names, that is: a top-level module may also import a tool (sys)."""
    tree = ast.parse(MODULES[face].read_text())
    imported, others, listed = [], [], None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names = [alias.asname or alias.name for alias in node.names]
            (imported if _resolve(face, node).startswith("jaxstep") else others).extend(names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                (imported if alias.name.startswith("jaxstep") else others).append(name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            listed = ast.literal_eval(node.value)
    assert listed is not None, f"{path_of(face)} has no __all__"
    assert listed == sorted(listed), f"{path_of(face)}: __all__ is not sorted"
    assert sorted(listed) == sorted(imported), (
        f"{path_of(face)}: imported but not in __all__: {sorted(set(imported) - set(listed))}; "
        f"in __all__ but not imported: {sorted(set(listed) - set(imported))}"
    )
    if is_package(face):
        assert not others, f"{path_of(face)}: a sub-package's face only re-exports: {others}"


#: The modules the docs send users to: every module outside ``_src`` (``import
#: jaxstep``, ``jaxstep.plot``, ``jaxstep.data``, ``jaxstep.launch``,
#: ``jaxstep.testing``, ``jaxstep.flax``, ``jaxstep.distributed`` and its ``reports``).
OUTSIDE_SRC = sorted(m for m in MODULES if m != SRC and not m.startswith(SRC + "."))
#: Of those, the modules whose names are each public thing's one path: the modules of
#: ``__all__`` one level down (``jaxstep.distributed.reports`` is a namespace users may
#: also reach as ``jaxstep.distributed.reports``; the pytest plugin is loaded by pytest).
PUBLIC_FACES = [m for m in OUTSIDE_SRC if m.count(".") <= 1]
#: The layers' faces: each ``__init__.py`` under ``_src``, for the layers above them.
LAYER_FACES = [m for m in MODULES if is_package(m) and m.startswith(SRC + ".")]


def _listed(module: str) -> list[str]:
    """A module's ``__all__``."""
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path_of(module)} has no __all__")


def origin(module: str, name: str) -> str:
    """Where the ``name`` a module holds is made (``pkg._mod.name``, or the module
    ``pkg.name`` itself): followed through each ``from ... import`` that hands it on."""
    if f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    for node in ast.parse(MODULES[module].read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.module != "__future__"):
            continue
        target = _resolve(module, node)
        for alias in node.names:
            if (alias.asname or alias.name) == name and target in MODULES:
                return origin(target, alias.name)
    return f"{module}.{name}"


def _module_of(thing: str) -> str:
    """The module of what :func:`origin` found: itself, or the module that makes it."""
    return thing if thing in MODULES else thing.rsplit(".", 1)[0]


def test_the_walk_follows_a_name_to_the_module_that_makes_it():
    assert {"jaxstep", "jaxstep.plot", "jaxstep.data", "jaxstep.testing"} <= set(PUBLIC_FACES)
    assert "jaxstep._src.loop" in LAYER_FACES and "jaxstep.testing" not in LAYER_FACES
    assert origin("jaxstep", "fit") == "jaxstep._src.loop._fit.fit"  # through jaxstep._src.loop
    assert origin("jaxstep", "testing") == "jaxstep.testing"  # a module
    assert origin("jaxstep.testing", "Fault") == "jaxstep._src.program._faults.Fault"


def _paths(faces: list[str]) -> dict[str, list[str]]:
    """Each thing the ``__all__`` of these modules lists: the paths listing it."""
    found: dict[str, list[str]] = {}
    for face in faces:
        if "__all__" in MODULES[face].read_text():
            for name in _listed(face):
                found.setdefault(origin(face, name), []).append(f"{face}.{name}")
    return found


def test_a_public_thing_has_one_public_path():
    """No two public modules list the same thing (``jaxstep.X`` and ``jaxstep.plot.X``):
    the docs, a search and an editor's completion find one name for it."""
    twice = [f"{t}: {', '.join(p)}" for t, p in _paths(PUBLIC_FACES).items() if len(p) > 1]
    assert not twice, "public things with more than one public path:\n" + "\n".join(twice)


#: What a public face may hold besides its imports, its docstring and ``__all__``: the
#: package's version and its lazy ``jaxstep.flax``, and a command's ``__main__`` guard.
FACE_EXTRAS = {"jaxstep": {"__version__", "__getattr__"}, "jaxstep.launch": {"__main__"}}


def _defined(module: str) -> list[str]:
    """What a module's top level does besides importing, documenting and ``__all__``."""
    found = []
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
            "__all__"
        ]:
            continue
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found.append(node.name)
        elif isinstance(node, ast.Try):
            found += [
                t.id
                for n in ast.walk(node)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            ]
        elif isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            found.append("__main__")
        else:
            found.append(ast.unparse(node).splitlines()[0])
    return found


@pytest.mark.parametrize("face", OUTSIDE_SRC, ids=path_of)
def test_a_public_face_only_hands_names_on(face):
    """Everything outside ``jaxstep/_src`` re-exports (optax's and orbax's faces over
    their ``_src``): a reader lists the package and sees the public face, and the code
    lives in one place, under ``_src``."""
    extra = set(_defined(face)) - FACE_EXTRAS.get(face, set())
    if face == "jaxstep.__main__":  # ``python -m jaxstep``: the command, called
        extra -= {"sys.exit(main())"}
    assert not extra, f"{path_of(face)} does more than hand names on: {sorted(extra)}"


def test_the_internals_are_reached_only_through_jaxstep_src():
    """No module under ``_src`` imports a public face: the faces sit on top."""
    upward = [
        str(i) for i in IMPORTS if i.source.startswith(SRC) and package_of(i.target) == "faces"
    ]
    assert not upward, "internals importing a public face:\n" + "\n".join(upward)


@pytest.mark.parametrize("face", LAYER_FACES, ids=path_of)
def test_a_layers_face_lists_only_what_its_own_package_makes(face):
    """A layer's face hands on its own package's names; a layer above takes another
    package's names from that package's face, and a user from a public module: a name
    handed on twice is a second path to keep in step."""
    foreign = [
        f"{name} (made in {origin(face, name)})"
        for name in _listed(face)
        if package_of(_module_of(origin(face, name))) != package_of(face)
    ]
    assert not foreign, f"{path_of(face)} hands on another package's names: {foreign}"


def _private(dotted: str) -> bool:
    """A private part (``_mod``, ``_name``); ``_src`` itself is where every layer is."""
    return any(
        part.startswith("_") and not part.startswith("__") and part != "_src"
        for part in dotted.split(".")
    )


def test_no_module_imports_the_private_names_of_another_package():
    """``from jaxstep.pkg._mod import name`` only within ``pkg``; others import what the
    face ``jaxstep.pkg`` lists (annotations under TYPE_CHECKING too). Tests may."""
    reaching: dict[tuple[str, str], list[Import]] = {}
    for i in IMPORTS:
        if package_of(i.source) == package_of(i.target):
            continue
        if _private(i.target) or any(_private(n) for n in i.names):
            reaching.setdefault((i.source, i.target), []).append(i)
    lines = [
        f"{path_of(source)}:{found[0].line}: {target} "
        f"({', '.join(n for i in found for n in i.names) or 'the module'})"
        for (source, target), found in reaching.items()
    ]
    assert not lines, "private names of another package:\n" + "\n".join(lines)


def _classes() -> dict[str, list[str]]:
    """Each class name the package defines: where (``path:line``)."""
    found: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path_of(module)}:{node.lineno}")
    return found


def test_no_class_name_is_defined_twice():
    """One word, one meaning: two classes of one name (a loop action and a record both
    called Recovery) make a reader hold both in mind at every use."""
    twice = {name: where for name, where in _classes().items() if len(where) > 1}
    assert not twice, "class names defined more than once: " + "; ".join(
        f"{name} ({', '.join(where)})" for name, where in sorted(twice.items())
    )


def test_a_face_hands_each_name_on_under_its_own_name():
    """``from ._mod import x as y`` with ``y != x`` renames on the way out: the name a
    reader finds in the code is not the one the layers above use."""
    renamed = []
    for module, path in MODULES.items():
        if not is_package(module):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                renamed += [
                    f"{path_of(module)}:{node.lineno}: {a.name} as {a.asname}"
                    for a in node.names
                    if a.asname is not None and a.asname != a.name
                ]
    assert not renamed, "names renamed on the way out:\n" + "\n".join(renamed)


def test_no_code_is_kept_from_the_formatter():
    """No ``# fmt: skip`` / ``# fmt: off``: a statement packed to meet a bound is a
    smell the bound exists to find (split where the concepts part instead)."""
    marked = [
        f"{path_of(module)}:{i}"
        for module, path in MODULES.items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not marked, "code the formatter is told to leave alone:\n" + "\n".join(marked)


#: A class whose private attributes only its own module touches, and that module.
OWNERS = {"TrainStep": "jaxstep._src.step._train_step", "Runtime": "jaxstep._src.step._runtime"}


def _private_attributes(module: str) -> set[str]:
    """The ``self._name`` attributes a module's methods assign."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            names.add(node.attr)
    return names


def test_only_its_own_module_touches_the_insides_of_a_step_or_its_runtime():
    """A step's private state has one owner: ``x._runtime``, ``x._last_state`` and the
    like appear only in the module that defines the class (the layers above call the
    runtime's methods: ``runtime_of(step).dispatch(...)``)."""
    private = {name: _private_attributes(owner) for name, owner in OWNERS.items()}
    assert "_runtime" in private["TrainStep"] and "_last_state" in private["Runtime"]
    owners = set(OWNERS.values())
    reaching = []
    for module, path in MODULES.items():
        if module in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            own = isinstance(node, ast.Attribute) and (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            )
            if (
                isinstance(node, ast.Attribute)
                and not own
                and any(node.attr in p for p in private.values())
            ):
                reaching.append(f"{path_of(module)}:{node.lineno}: .{node.attr}")
    assert not reaching, "private attributes of a step or runtime used elsewhere:\n" + "\n".join(
        reaching
    )

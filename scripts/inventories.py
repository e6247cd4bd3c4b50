"""Refreshes docs/_inventories/: the intersphinx inventories the site links Python,
numpy, JAX, optax, flax and orbax names through (docs/conf.py reads them by path, so
the build runs offline).

Online (``--download``), each project's official ``objects.inv`` is fetched from its
site (docs/conf.py's ``INTERSPHINX_SITES``). Offline (the default, and where a download
fails), a minimal inventory is built from the installed packages: the names jaxstep's
docs refer to, each mapped to the page its project documents it on (the URL patterns
below, read from each project's documentation sources). Either way, every name the
docs refer to by a path of its own (an annotation reads ``optax._src.base.
GradientTransformation``, ``jaxlib._jax.Device``, ``np.ndarray``) gets an entry of
that spelling beside the public one, on the public one's page: autodoc writes an
annotation's target where its object is defined, which no official inventory lists.

The names referred to are found by building the site once (notebooks not executed)
and recording each Python reference that no page of the site resolves (Sphinx's
``missing-reference``, heard before intersphinx answers it).

Run it after a release of one of the projects, or when the docs refer to new names::

    python scripts/inventories.py             # offline: built from the packages
    python scripts/inventories.py --download  # online: the official inventories
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import io
import runpy
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sphinx.util.inventory import InventoryFile

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUT = DOCS / "_inventories"

#: the type-to-page rules of Python's own docs: builtins documented in functions.rst
BUILTIN_FUNCTIONS_PAGE = {"int", "float", "bool", "complex", "object", "type", "slice"}
#: Python's constants (constants.rst), which are no attributes of ``builtins``
CONSTANTS = {"None": None, "True": True, "False": False, "Ellipsis": Ellipsis}
#: the names the projects are imported as (an annotation left a string reads ``np.``)
IMPORTED_AS = {"np": "numpy", "jnp": "jax.numpy"}
#: where a bare name of an annotation left a string comes from (``Mapping``)
BARE_SCOPES = ("collections.abc", "typing", "builtins")


def python_page(name: str, kind: str) -> str | None:
    if "." not in name:
        if kind == "exception":
            return "library/exceptions.html"
        if name in CONSTANTS:
            return "library/constants.html"
        if name in BUILTIN_FUNCTIONS_PAGE or kind == "function":
            return "library/functions.html"
        return "library/stdtypes.html"
    return f"library/{name.rsplit('.', 1)[0]}.html"


def numpy_page(name: str, kind: str) -> str | None:
    return f"reference/generated/{name}.html"


#: JAX's modules documented on a page of their own (``.. autoclass::`` in
#: docs/jax.sharding.rst, docs/jax.stages.rst); every other name has an autosummary
#: page of its own (``:toctree: _autosummary``)
JAX_MODULE_PAGES = {"jax.sharding", "jax.stages"}


def jax_page(name: str, kind: str) -> str | None:
    module = name.rsplit(".", 1)[0]
    return f"{module}.html" if module in JAX_MODULE_PAGES else f"_autosummary/{name}.html"


def optax_page(name: str, kind: str) -> str | None:
    return f"api/generated/{name}.html"  # docs/api/*.rst: autosummary, :toctree: generated/


#: flax.nnx's reference pages (docs_nnx/api_reference/flax.nnx/*.rst), by name; the
#: site at flax.readthedocs.io is NNX's (linen has a site of its own)
FLAX_PAGES = {"flax.nnx.Module": "module", "flax.nnx.State": "state", "flax.nnx.Rngs": "rnglib"}


def flax_page(name: str, kind: str) -> str | None:
    page = FLAX_PAGES.get(name)
    return None if page is None else f"api_reference/flax.nnx/{page}.html"


#: orbax's reference pages (docs/api_reference/*.rst), by name
ORBAX_PAGES = {
    "orbax.checkpoint.CheckpointManager": "checkpoint.checkpoint_manager",
    "orbax.checkpoint.CheckpointManagerOptions": "checkpoint.checkpoint_manager",
    "orbax.checkpoint.args.StandardSave": "checkpoint.args",
    "orbax.checkpoint.args.JsonSave": "checkpoint.args",
}


def orbax_page(name: str, kind: str) -> str | None:
    page = ORBAX_PAGES.get(name)
    return None if page is None else f"api_reference/{page}.html"


@dataclass(frozen=True)
class Project:
    """A project the site links to.

    Attributes:
      packages: the top-level modules whose objects its docs describe.
      namespaces: where its docs document names, in order (an object is named by
        the first that holds it).
      page: ``page(public name, kind)``: the page documenting it, relative to the
        site, or None where the rule does not know it (the name is left out).
      extra: public names the docs mention that get an entry even before a page
        refers to one (so a new ``:class:`jax.sharding.Mesh``` links at once).
    """

    packages: tuple[str, ...]
    namespaces: tuple[str, ...]
    page: Callable[[str, str], str | None]
    extra: tuple[str, ...] = ()


PROJECTS = {
    "python": Project(("builtins",), ("builtins",), python_page),
    "numpy": Project(("numpy",), ("numpy",), numpy_page, ("numpy.ndarray", "numpy.dtype")),
    "jax": Project(
        ("jax", "jaxlib"),
        # jax holds jax.sharding's classes too, undocumented there (jax.P), and
        # jax.numpy.ndarray is jax.Array: the most specific first
        ("jax.sharding", "jax.stages", "jax", "jax.numpy", "jax.tree_util", "jax.distributed"),
        jax_page,
        (
            "jax.Array",
            "jax.Device",
            "jax.jit",
            "jax.make_mesh",
            "jax.shard_map",
            "jax.tree_util.keystr",
            "jax.distributed.initialize",
            "jax.sharding.Mesh",
            "jax.sharding.NamedSharding",
            "jax.sharding.PartitionSpec",
            "jax.sharding.Sharding",
            "jax.stages.Compiled",
            "jax.stages.Lowered",
        ),
    ),
    "optax": Project(
        ("optax",),
        ("optax",),
        optax_page,
        (
            "optax.GradientTransformation",
            "optax.MultiSteps",
            "optax.apply_updates",
            "optax.apply_if_finite",
            "optax.clip_by_global_norm",
            "optax.adam",
            "optax.sgd",
        ),
    ),
    "flax": Project(("flax",), ("flax.nnx",), flax_page, tuple(FLAX_PAGES)),
    "orbax": Project(
        ("orbax",), ("orbax.checkpoint", "orbax.checkpoint.args"), orbax_page, tuple(ORBAX_PAGES)
    ),
}


@dataclass(frozen=True)
class Entry:
    """One name of an inventory: ``name`` as the docs spell it, documented at
    ``page#anchor`` as ``public``."""

    name: str
    kind: str
    page: str
    public: str


def kind_of(obj: Any) -> str:
    """The Python domain's object type of ``obj``."""
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "data"


def lookup(target: str, context: str = "") -> Any:
    """The object ``target`` names, read as Python would: a module path and attributes,
    else a name of the module ``context``, of :data:`BARE_SCOPES` or a project as it is
    imported (``np.ndarray``). A class's own spelling of its path counts too: jax
    writes ``jax.Array`` as ``jax.jaxlib._jax.Array`` (its module, ``jax``, and its
    name, ``jaxlib._jax.Array``). Raises LookupError when nothing answers."""
    if target in CONSTANTS:
        return CONSTANTS[target]
    parts = target.split(".")
    if parts[0] in IMPORTED_AS:
        parts = [*IMPORTED_AS[parts[0]].split("."), *parts[1:]]
    try:
        return _attributes(parts, context)
    except LookupError:
        if len(parts) < 2:
            raise
        return _attributes(parts[1:], context)


def _attributes(parts: list[str], context: str) -> Any:
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            break
        return obj
    modules = [context] if context else []
    for scope in [vars(importlib.import_module(m)) for m in [*modules, *BARE_SCOPES]]:
        if parts[0] in scope:
            obj = scope[parts[0]]
            try:
                for part in parts[1:]:
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            return obj
    raise LookupError(".".join(parts))


def project_of(obj: Any) -> str | None:
    """The project whose docs describe ``obj``: by the top package that defines it
    (the standard library's are Python's), or None (matplotlib, jaxstep)."""
    if obj is None or isinstance(obj, bool) or obj is Ellipsis:
        return "python"
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    top = (module or "").split(".")[0]
    for name, project in PROJECTS.items():
        if top in project.packages:
            return name
    return "python" if top in sys.stdlib_module_names else None


def public_name(target: str, obj: Any, project: str) -> str | None:
    """The name ``obj`` is documented under: ``target`` itself when it names it in one
    of the project's namespaces, else the first of them that holds it (the standard
    library: ``target`` when no part of it is private, else its module's public
    path)."""
    if project == "python":
        if target in CONSTANTS or getattr(builtins, target, None) is obj:
            return target
        if not any(p.startswith("_") for p in target.split(".")) and "." in target:
            return target
        module = ".".join(p for p in obj.__module__.split(".") if not p.startswith("_"))
        return f"{module}.{obj.__qualname__}"
    namespaces = PROJECTS[project].namespaces
    head, *rest = target.split(".")
    written = ".".join([IMPORTED_AS.get(head, head), *rest])  # np.ndarray: numpy.ndarray
    if written.rsplit(".", 1)[0] in namespaces:
        return written
    short = getattr(obj, "__name__", "").rsplit(".", 1)[-1]
    for namespace in namespaces:
        space = vars(importlib.import_module(namespace))
        if space.get(short) is obj:
            return f"{namespace}.{short}"
        held = sorted(k for k, v in space.items() if v is obj and not k.startswith("_"))
        if held:
            return f"{namespace}.{held[0]}"
    return None


def entries(targets: Iterable[tuple[str, str]]) -> tuple[dict[str, list[Entry]], list[str]]:
    """Each project's entries for ``targets`` (``(name, context module)``) and its
    extra names, and what could not be placed (a line each)."""
    out: dict[str, dict[str, Entry]] = {name: {} for name in PROJECTS}
    skipped = []
    extra = [(n, "") for project in PROJECTS.values() for n in project.extra]
    for target, context in [*extra, *targets]:
        try:
            obj = lookup(target, context)
        except (LookupError, ImportError):
            skipped.append(f"{target}: not found")
            continue
        project = project_of(obj)
        if project is None:
            continue  # not a project the site links to
        public = public_name(target, obj, project)
        page = None if public is None else PROJECTS[project].page(public, kind_of(obj))
        if public is None or page is None:
            skipped.append(f"{target}: no page known in {project}'s docs")
            continue
        for name in dict.fromkeys([public, target]):
            out[project][name] = Entry(name, kind_of(obj), page, public)
    return {p: sorted(e.values(), key=lambda e: e.name) for p, e in out.items()}, skipped


def references() -> list[tuple[str, str]]:
    """The Python names the site refers to that none of its pages documents, each
    with the module it is read in: one build (HTML, notebooks not run) records them."""
    from sphinx.application import Sphinx

    seen: set[tuple[str, str]] = set()

    def record(app: Any, env: Any, node: Any, contnode: Any) -> None:
        if node.get("refdomain") == "py":
            seen.add((node["reftarget"], node.get("py:module") or ""))

    with tempfile.TemporaryDirectory() as tmp:
        app = Sphinx(
            DOCS,
            DOCS,
            Path(tmp, "html"),
            Path(tmp, "doctrees"),
            "html",
            confoverrides={"nb_execution_mode": "off"},
            status=None,
            warning=io.StringIO(),
            freshenv=True,
        )
        app.connect("missing-reference", record, priority=100)  # before intersphinx
        app.build()
    return sorted(seen)


def write(path: Path, project: str, version: str, items: list[tuple[str, ...]]) -> None:
    """Writes an inventory with Sphinx's own writer. ``items``: ``(name, domain:type,
    page, anchor, display name)``."""
    by_domain: dict[str, list[tuple[str, str, str, str, str, int]]] = {}
    for name, role, page, anchor, display in items:
        domain, kind = role.split(":", 1)
        by_domain.setdefault(domain, []).append((name, display, kind, page, anchor, 1))
    domains = [
        SimpleNamespace(name=d, get_objects=lambda objs=objs: iter(objs))
        for d, objs in sorted(by_domain.items())
    ]
    env = SimpleNamespace(
        config=SimpleNamespace(project=project, version=version),
        domains=SimpleNamespace(sorted=lambda: iter(domains)),
    )
    builder = SimpleNamespace(get_target_uri=lambda docname: docname)
    path.parent.mkdir(parents=True, exist_ok=True)
    InventoryFile.dump(path, env, builder)  # type: ignore[arg-type]


def built(project: str, found: list[Entry]) -> list[tuple[str, ...]]:
    """The items of a built inventory: ``found``, each on its public name's page."""
    return [
        (e.name, f"py:{e.kind}", e.page, e.public, e.public if e.name != e.public else "-")
        for e in found
    ]


def downloaded(site: str, found: list[Entry]) -> list[tuple[str, ...]]:
    """The items of the official inventory at ``site``, and each name of ``found``
    that it lacks (a private spelling) on its public name's page there."""
    with urllib.request.urlopen(site + "objects.inv", timeout=30) as response:
        data = response.read()
    inventory = InventoryFile.loads(data, uri="")
    items = []
    where = {}
    for role, names in _as_dict(inventory).items():
        for name, item in names.items():
            page, _, anchor = item.uri.partition("#")
            items.append((name, role, page, anchor, item.display_name))
            if role.startswith("py:"):
                where[name] = (role, page, anchor)
    for e in found:
        if e.name not in where and e.public in where:
            role, page, anchor = where[e.public]
            items.append((e.name, role, page, anchor, e.public))
    return items


def _as_dict(inventory: Any) -> dict[str, dict[str, Any]]:
    """``{role: {name: item}}`` of a loaded inventory (Sphinx 8.2+ wraps it)."""
    return getattr(inventory, "data", inventory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--download", action="store_true", help="fetch the official inventories (online)"
    )
    args = parser.parse_args(argv)
    sites = runpy.run_path(str(DOCS / "conf.py"))["INTERSPHINX_SITES"]
    by_project, skipped = entries(references())
    for line in skipped:
        print(f"not linked: {line}")
    for project, found in by_project.items():
        path = OUT / f"{project}.inv"
        items = None
        if args.download:
            try:
                items = downloaded(sites[project], found)
                how = f"downloaded from {sites[project]}"
            except OSError as err:
                print(f"{project}: download failed ({err}); building it instead")
        if items is None:
            spec = PROJECTS[project]
            modules = [importlib.import_module(m) for m in (spec.packages[0], spec.namespaces[0])]
            versions = [getattr(m, "__version__", None) for m in modules]
            version = next((v for v in versions if v), sys.version.split()[0])
            items, how = built(project, found), f"built from {project} {version}"
        else:
            version = "latest"
        if not items:
            path.unlink(missing_ok=True)
            print(f"{project}: no name referred to; no inventory")
            continue
        write(path, project, version, items)
        check = InventoryFile.loads(path.read_bytes(), uri=sites[project])
        count = sum(len(names) for names in _as_dict(check).values())
        print(f"{path.relative_to(ROOT)}: {count} names, {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

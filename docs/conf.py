"""Sphinx configuration: ``make docs`` builds the site into ``docs/_build/html``.

The landing page is the README (docs/index.md includes it), the guides are the
markdown pages of docs/ as they are, the notebooks (docs/notebooks links to
../notebooks) run in the build on 8 fake CPU devices, and the API reference
(docs/api/) is written from the docstrings. The build runs with ``-W --keep-going``:
any warning fails it, and so does a public name with no entry in the reference
(docs/ext/coverage_check.py).
"""

import os
import pathlib
import sys
import tomllib

from sphinx.ext.napoleon.docstring import GoogleDocstring

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "ext"))

# The notebooks' kernels inherit this environment: CPU JAX (where the fake devices
# live; each notebook's first cell asks for 8 of them before JAX starts), and
# matplotlib's inline backend, so the pictures land in the pages (an MPLBACKEND set for
# tests, Agg, would keep them out).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("MPLBACKEND", None)

project = "jaxstep"
author = "the jaxstep authors"
copyright = "the jaxstep authors"
# The version lives in pyproject.toml alone (jaxstep.__version__ reads the metadata).
release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
version = release

extensions = [
    "myst_nb",  # markdown pages (it brings myst_parser) and executed notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # Google-style docstrings
    "sphinx.ext.intersphinx",  # Python, numpy, JAX, optax, flax names link to their docs
    "sphinx_copybutton",
    "coverage_check",  # docs/ext: a public name missing from the reference fails the build
    "repo_links",  # docs/ext: links to README/CHANGELOG/BENCHMARKS land on their pages
]

root_doc = "index"
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# -- MyST ---------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence"]
# Links such as recovery.md#models-that-communicate-and-random-numbers (and the
# README's #the-demo-and-the-doctor) resolve to the heading, as on GitHub.
myst_heading_anchors = 4

# -- Notebooks: executed in every build, an error fails it ---------------------------
nb_execution_mode = os.environ.get("JAXSTEP_DOCS_EXECUTE", "force")
nb_execution_allow_errors = False
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 180  # seconds a cell may take (tests/docs runs the build)
nb_merge_streams = True

# -- API reference --------------------------------------------------------------------
autosummary_generate = False  # the pages in docs/api/ are written, not generated
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = False  # an Attributes entry is an object: searchable, linkable
# An attribute's type would be written where it is defined (jaxstep._src.core._state.X): the
# class's signature shows the types, as the code writes them.
napoleon_attr_annotations = False
# A reference to a name the site does not document is a warning, and so an error: a
# docstring that points at a renamed, removed or internal name fails the build.
nitpicky = True
# matplotlib's names (no inventory kept) stay plain text.
nitpick_ignore_regex = [
    ("py:(class|data|obj|exc|func|meth)", r"matplotlib\..*"),
    ("py:class", r"(Axes|Figure|FigureBase|AxesImage)"),
]
# Types that public signatures name but that have no public name of their own: they
# show unlinked. Each is a question for the public face (export it, or stop naming it).
UNNAMED_TYPES = [
    "LossScaleState",
    "StepInfo",
    "PyTree",
    "Entry",
    "Quarantine",
    "Emergency",
    "Options",
    "_F",
]
# (as annotations name them: bare, or where they are defined, in a private module)
nitpick_ignore_regex += [
    ("py:class", rf"(jaxstep\.[\w.]*\._\w+\.)?{name}") for name in UNNAMED_TYPES
]

# -- Links to other projects' references --------------------------------------------
# The build runs offline (in CI, on devices without a network): each project's
# inventory is kept in docs/_inventories/, refreshed by scripts/inventories.py (the
# official one where it can download it, else one it builds from the installed package
# with the names the site refers to). A project without one there is not linked.
INTERSPHINX_SITES = {
    "python": "https://docs.python.org/3/",
    "numpy": "https://numpy.org/doc/stable/",
    "jax": "https://docs.jax.dev/en/latest/",
    "optax": "https://optax.readthedocs.io/en/latest/",
    "flax": "https://flax.readthedocs.io/en/latest/",
    "orbax": "https://orbax.readthedocs.io/en/latest/",
}
intersphinx_mapping = {
    name: (site, str(DOCS / "_inventories" / f"{name}.inv"))
    for name, site in INTERSPHINX_SITES.items()
    if (DOCS / "_inventories" / f"{name}.inv").exists()
}

# -- HTML -----------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxstep {release}"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": True,
}
html_static_path: list[str] = []


# -- Hooks ---------------------------------------------------------------------------
def _skip_member(app, what, name, obj, skip, options):
    """A NamedTuple's fields come with the docstring "Alias for field number N": the
    class's Attributes section is their entry (two entries would clash)."""
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    return skip


def _plain_attribute_docstring(self):
    """An attribute's or property's docstring as plain text: napoleon reads the first
    line of one as ``type: text`` when it holds a colon, and jaxstep's types are their
    annotations ("The ids of the devices: ..." is no type)."""
    lines = self._dedent(self._consume_to_end())
    return self.__class__(lines, self._config).lines()


GoogleDocstring._parse_attribute_docstring = _plain_attribute_docstring


def setup(app):
    app.connect("autodoc-skip-member", _skip_member)

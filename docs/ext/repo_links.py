"""Links that work on GitHub work on the site.

The README is the landing page's source (docs/index.md includes it; the include's
``relative-docs`` option rewrites its ``docs/...`` links), and the notebooks are
pages through the docs/notebooks link to ../notebooks. Two kinds of link need more
than that, and are mended here, before references are resolved:

- a link to a file at the repository's root that the site carries as a page of its
  own (``BENCHMARKS.md``, ``CHANGELOG.md``, ``README.md``), resolved relative to the
  file the link is written in;
- a link to a notebook, which Sphinx resolves through the link to ../notebooks,
  outside the source directory.
"""

from __future__ import annotations

import os
from typing import Any

from sphinx import addnodes
from sphinx.transforms import SphinxTransform

#: repository root file -> the page that carries it
PAGES = {"README.md": "index", "BENCHMARKS.md": "benchmarks", "CHANGELOG.md": "changelog"}


class RepoLinks(SphinxTransform):
    """Points myst links to repository files that the site carries at their pages."""

    default_priority = 5  # at reading: before myst resolves its references

    def apply(self, **kwargs: Any) -> None:
        root = os.path.dirname(os.path.abspath(self.env.srcdir))
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("reftype") != "myst" or node.get("refdomain") not in (None, "doc"):
                continue
            target = str(node["reftarget"])
            if node.get("refdomain") is None:  # a path myst found no page for
                target, _, anchor = target.partition("#")
                source = node.source or str(self.env.doc2path(self.env.docname))
                path = os.path.join(os.path.dirname(str(source)), target)
            elif os.path.isabs(target):  # a page found through a link out of docs/
                path, anchor = target, node.get("reftargetid") or ""
            else:
                continue
            page = self.page(os.path.relpath(os.path.normpath(path), root))
            if page is not None:
                node["refdomain"], node["reftarget"] = "doc", page
                node["reftargetid"] = anchor or None

    def page(self, relative: str) -> str | None:
        """The page of a path relative to the repository's root, if the site has one."""
        if relative in PAGES:
            return PAGES[relative]
        stem, _ = os.path.splitext(relative)
        for doc in (relative, stem):
            if doc in self.env.found_docs:
                return doc
        return None


def setup(app: Any) -> dict[str, Any]:
    app.add_transform(RepoLinks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

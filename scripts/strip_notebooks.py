"""Clears the outputs and execution counts of notebooks, in place:
``python scripts/strip_notebooks.py notebooks/*.ipynb`` (``make strip-notebooks``)."""

import sys

import nbformat


def main(paths: list[str]) -> None:
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb.metadata.pop("widgets", None)
        nbformat.write(nb, path)


if __name__ == "__main__":
    main(sys.argv[1:])

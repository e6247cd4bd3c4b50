# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean strip-notebooks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxstep demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -n 2 --durations=15

# Notebooks are committed without outputs (tests/notebook/test_notebook.py runs them).
strip-notebooks: $(STAMP)
	$(BIN)/python scripts/strip_notebooks.py notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python scripts/bench.py --json bench.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Entry points for a newcomer: `make demo`, `make test` and `make docs`. Each creates .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs bench clean strip-notebooks

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/jaxstep demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two workers, a test module on one (--dist loadscope): spread test by test, a module's
# module-scoped fixture was built on both (measured: the two multi-process modules' jobs
# ran twice, 377 s for the two modules where 188 s do; xdist_group marks, the finer
# tool, are not honoured under pytest 9). XLA's compiled programs are cached on disk
# in .venv (a step many tests build alike, and the processes they start, compile once;
# a clean clone starts with none).
test: lint
	JAX_COMPILATION_CACHE_DIR=$(abspath $(VENV))/jax-cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --durations=25

# The site, into docs/_build/html: the README as its landing page, the guides in docs/,
# the notebooks executed, the API reference; any warning or a public name missing from
# the reference fails it (tests/docs/test_docs.py runs the same build in the suite).
# Every page is read afresh (-E): the notebooks' outputs follow the package's code,
# which Sphinx does not watch.
docs: $(STAMP)
	$(BIN)/python -m sphinx -E -W --keep-going -b html docs docs/_build/html

# Notebooks are committed without outputs (the docs build runs them).
strip-notebooks: $(STAMP)
	$(BIN)/python scripts/strip_notebooks.py notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python scripts/bench.py --json bench.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache docs/_build

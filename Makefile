# The two commands of the README do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: demo test bench lint format clean docs

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

demo: $(STAMP)
	$(PY) -m jdp.demo $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check jdp tests benchmarks notebooks
	$(PY) -m ruff format --check jdp tests benchmarks notebooks
	$(PY) -m pytest -n 3 --dist loadgroup $(PYTEST_ARGS)

# The documentation site (docs/README.md): notebooks executed, warnings are errors.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs/_build/html/index.html"

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

lint: $(STAMP)
	$(PY) -m ruff check jdp tests benchmarks notebooks

format: $(STAMP)
	$(PY) -m ruff format jdp tests benchmarks notebooks
	$(PY) -m ruff check --fix jdp tests benchmarks notebooks

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info

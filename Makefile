# Two commands for a newcomer: `make demo` and `make test`.  Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test

.PHONY: demo test lint typecheck unit bench clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/capgate demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

unit: $(STAMP)
	scripts/install-test-extensions
	$(VENV)/bin/pytest

test: lint unit

bench: $(STAMP)
	$(PY) bench/registry.py

clean:
	rm -rf $(VENV) .capgate .pytest_cache .mypy_cache .ruff_cache

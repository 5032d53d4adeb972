# Two commands for a newcomer: `make demo` and `make test`.  Each sets itself up.
# `make demo` installs capgate alone (what the demo needs); `make test` adds the test
# toolchain.  `make wheel-check` proves a plain `pip install` the way CI does.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test
DEMO_STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench wheel wheel-check clean

$(PY):
	python3 -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@ $(DEMO_STAMP)

demo: $(DEMO_STAMP)
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
	$(PY) bench/startup.py

# the wheel, for `pip install dist/capgate-*.whl` on another machine
wheel: $(PY)
	$(PY) -m pip wheel -q --no-deps -w dist .

wheel-check:
	scripts/wheel-check

clean:
	rm -rf $(VENV) .capgate .pytest_cache .mypy_cache .ruff_cache build dist

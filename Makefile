# The two commands of the README:
#   make demo   set up, then run the demo on the embedded default (CPU, local storage, local Prefect)
#   make test   set up, then lint (ruff check + format check) and run the test suite
.PHONY: setup demo lint test bench-docs
VENV := .venv
PY := $(VENV)/bin/python

setup: $(VENV)/.ready
$(VENV)/.ready: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

demo: setup
	$(VENV)/bin/ppoflow demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q

bench-docs: setup
	$(PY) -m bench.report

# The two commands of the README. Each builds its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean image-test

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[server,torch,dev]'
	touch $(STAMP)

## demo: the main job on the embedded defaults (SQLite, local spot provider, local store, terminal)
demo: $(STAMP)
	$(VENV)/bin/trainbot demo $(ARGS)

## test: lint, type-check and the whole test suite, on two workers (most of its time is
## spent waiting on processes, servers and timers; PYTEST_WORKERS=0 runs it in one process)
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

## image-test: build the deploy/ images with podman, serve /healthz, compose up two replicas
image-test: $(STAMP)
	TRAINBOT_TEST_CONTAINERS=1 $(PY) -m pytest -m container -s tests/deploy/test_container.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(PY) -m mypy

## bench: every benchmark in quick mode
bench: $(STAMP)
	for b in bench/bench_*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# make run   sets up (once) and runs the main job: 2 trainers on this machine
# make test  sets up (once, with test tools), lints and type-checks, and runs the test suite, less its slow tests
# make lint  ruff (lint and format check) and mypy, as configured in pyproject.toml
# make test-fast  runs the unit tier only (pure logic, seconds)
# make test-slow  runs the slow tests: a real container build (Podman, root, minutes) and test-gpu-row
# make test-gpu-row  builds (once, ~5 GB in .venv-gpu-row) the GPU machine's version row, torch 2.11,
#                 and runs the unit tier, the main job, a resume and the plan preview on it (scripts/gpu_row.sh)
# make gpu-check  checks and measures this machine's NVIDIA GPUs (benchmarks/gpu_check.py)
VENV ?= .venv
PYTHON ?= python3
# torchrun, torchx and python of the project's environment come first on PATH.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install install-test run lint test test-fast test-slow test-gpu-row bench gpu-check clean

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: scripts/install.sh requirements.txt setup.py
	VENV=$(VENV) PYTHON=$(PYTHON) bash scripts/install.sh
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	touch $@

run: install
	torchx run -s local_cwd components.dlrm:train -j 1x2

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest tests

test-fast: install-test
	$(VENV)/bin/python -m pytest -m unit tests

test-slow: install-test
	$(VENV)/bin/python -m pytest -m slow tests

test-gpu-row:
	bash scripts/gpu_row.sh

bench: install
	$(VENV)/bin/python benchmarks/train_throughput.py

gpu-check: install
	$(VENV)/bin/python -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) outputs

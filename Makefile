# depthdiag: `make figure4` runs the whole pipeline, `make test` the tests.
# Every target below is a real file with its prerequisites, so a rerun with
# nothing changed does nothing.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel by default, so a CPU machine never downloads a CUDA build;
# on a GPU machine: make TORCH_SPEC='torch>=2.4,<3' ...
TORCH_SPEC ?= torch==2.13.0

CONFIG ?= configs/tiny.toml
NAME := $(basename $(notdir $(CONFIG)))

.PHONY: setup test test-slow bench clean flops
.DELETE_ON_ERROR:

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

flops: $(VENV)/.installed
	$(VENV)/bin/depthdiag flops configs/paper-200m.toml --updates 4800 --match uniform:1-16

clean:
	rm -rf runs results .pytest_cache

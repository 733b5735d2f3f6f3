# The two commands: `make demo` and `make test`. Both create .venv when it is missing.
TORCH_VERSION ?= 2.13.0
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-rl demo-rl-tools test test-all venv bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m loom.demo

# SFT then GRPO on CPU (bench/rl_demo.py): writes bench/results/rl_demo.json and .png.
demo-rl: $(STAMP)
	$(PY) bench/rl_demo.py

# Multi-turn GRPO with a calculator tool on CPU (bench/rl_tools_demo.py): held-out accuracy with and without the
# tool, before and after RL; writes bench/results/rl_tools_demo.json.
demo-rl-tools: $(STAMP)
	$(PY) bench/rl_tools_demo.py

# Two workers, each file on one of them (its module fixtures and kept rank processes shared by its tests), the
# longest files first (tests/conftest.py LONG_FIRST); each worker gets its share of the cores (OMP_NUM_THREADS).
# Measured times: bench/README.md ("The test suite and torch versions").
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

test-all: $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,eval]"
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/cpu_vs_hf.py

clean:
	rm -rf $(VENV) runs

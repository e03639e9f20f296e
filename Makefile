# verl_mas: two commands for a fresh machine. Both create or refresh ./.venv first (idempotent).
#   make demo   the main job: AT-GRPO through verl's main_ppo on CPU, a tiny model learning a two-role task
#   make test   the test suite CI runs (includes real verl/Ray runs; ~30 min on 2 cores)
# Knobs: PYTHON=python3.11  TORCH="torch==2.13.0"  PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
# A CPU build of torch. verl_mas admits torch>=2.8,<2.14; it is installed first so that resolving verl
# never pulls a multi-GB CUDA wheel on a CPU machine.
TORCH ?= torch==2.13.0
PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl_mas-installed

.PHONY: setup demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_ARGS) "$(TORCH)"
	$(PY) -m pip install -q $(PIP_ARGS) -e ".[test]"
	@touch $(STAMP)

demo: setup
	PYTHON=$(PY) VERL_MAS_RUN_DIR=runs/quickstart bash recipes/at_grpo_cpu/run.sh
	$(PY) -m verl_mas.report runs/quickstart/metrics.jsonl --plot runs/quickstart/curves.png

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache

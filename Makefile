# Set-up, demo and tests. Every target creates .venv on first use (CPU torch 2.13.0 only:
# the pin keeps pip from pulling a multi-GB CUDA build).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshforge-installed
TEST_ENV := $(CURDIR)/build/test-env
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# LLaMA-Factory is only a test reference for the SFT encoding: installed without its
# dependencies (a normal install pulls CUDA torchvision/torchaudio) into its own folder, and put on
# the path of that one test file only.
LF_REF := build/llamafactory-ref
LF_STAMP := $(LF_REF)/.installed
# TRL is only a test reference for the DPO, IPO and SimPO losses and gradients (tests/unit/test_dpo_trl.py
# finds this folder itself) and for benchmarks/dpo_step.py; --no-deps keeps torch pinned.
TRL_REF := build/trl-ref
TRL_STAMP := $(TRL_REF)/.installed

.PHONY: install demo test test-fast lint format bench check-pythons clean readme-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# torchft for parallelism.fault_tolerance (--no-deps: torch stays pinned); its tests skip without it.
	$(PY) -m pip install -q --no-deps torchft==0.2.0 || echo "warning: torchft==0.2.0 not installed; fault-tolerance tests will skip"
	touch $(STAMP)

# Each `make demo` trains afresh: the earlier demo run in output/demo is replaced, by request.
demo: $(STAMP)
	$(VENV)/bin/meshforge train --training.overwrite_output_dir true

define test_env
	mkdir -p $(TEST_ENV)/tmp $(TEST_ENV)/hf $(TEST_ENV)/inductor $(TEST_ENV)/tiktoken
	export TMPDIR=$(TEST_ENV)/tmp HF_HOME=$(TEST_ENV)/hf TORCHINDUCTOR_CACHE_DIR=$(TEST_ENV)/inductor \
	  TIKTOKEN_CACHE_DIR=$(TEST_ENV)/tiktoken OMP_NUM_THREADS=1;
endef

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks scripts
	$(VENV)/bin/ruff check --fix src tests benchmarks scripts

$(LF_STAMP): $(STAMP)
	DISABLE_VERSION_CHECK=1 $(PY) -m pip install -q --no-deps --target $(LF_REF) \
	  llamafactory==0.9.5 peft==0.21.2 omegaconf==2.4.0 accelerate==1.15.0
	touch $(LF_STAMP)

$(TRL_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(TRL_REF) trl==1.16.0
	touch $(TRL_STAMP)

# Two xdist workers: one runs the `procs` tests (the xdist group `procs`, one test at a time: their
# ranks, a shared pool, see tests/README.md, wait on each other's messages and leave most of a core
# idle), the other takes the tests that start no process beside it, and the first joins it once the
# group is done.
PYTEST := $(VENV)/bin/pytest -q
LF_TESTS := tests/unit/test_sft_llamafactory.py tests/unit/test_sft_llamafactory_eval.py \
  tests/unit/test_pairwise_llamafactory.py
NO_LF := $(foreach t,$(LF_TESTS),--ignore=$(t))

test: $(STAMP) lint $(LF_STAMP) $(TRL_STAMP)
	$(test_env) $(PYTEST) -n 2 --dist loadgroup --durations=25 tests $(NO_LF)
	$(test_env) PYTHONPATH=$(LF_REF) $(PYTEST) $(LF_TESTS) \
	  "tests/unit/test_tokenizer_extension.py::test_desc_init_cross_check_with_llamafactory"

test-fast: $(STAMP) lint
	$(test_env) $(PYTEST) -n 2 -m "not slow" tests

# Every command of README.md's shell blocks, in order, in a copy of the tracked tree (a fresh clone).
readme-check: $(STAMP)
	$(test_env) $(PY) scripts/readme_commands.py

# The other Python versions of requires-python (3.12, 3.13 where installed): the torch-free layer's tests.
check-pythons:
	scripts/check_python_versions.sh

bench: $(STAMP)
	$(PY) benchmarks/step_throughput.py

clean:
	rm -rf build output .pytest_cache .ruff_cache

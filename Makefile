# One entry point for set-up, tests, the demo and the benchmarks.  Every target is idempotent: it creates
# .venv if missing, installs the pinned dependencies, (re)builds the C++ extension, then does its job.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
# Threads for the kernels (OpenMP): `make test THREADS=4`, or an OMP_NUM_THREADS already in the caller's
# environment; 2 (this project's CI machine) otherwise.
THREADS ?= $(or $(OMP_NUM_THREADS),2)
SHELL   := /bin/bash
# pip's lines for what it downloads and installs, without one line per package already there.
QUIET_SATISFIED := { grep -v '^Requirement already satisfied' || true; }
# Lint tools are pinned: a new release may format differently, and `make lint` is part of `make test`.
LINT_DEPS := ruff==0.17.5 clang-format==23.1.3
# C++/CUDA sources under clang-format.
CXX_SOURCES = $(shell find csrc bench/micro tests/cuda/host tests/asan -name '*.h' -o -name '*.cpp' -o -name '*.cu' \
                -o -name '*.cuh' | sort)

.PHONY: all venv build test lint format asan mutate demo bench clean

all: test

$(STAMP): Makefile   # a changed dependency list re-runs the installs in an existing .venv
	test -x $(VPY) || $(PY) -m venv $(VENV)
	@echo "== installing the pinned dependencies into $(VENV) (torch is ~200 MB: a few minutes on a fresh machine)"
	set -o pipefail; $(VPY) -m pip install --progress-bar off --upgrade pip setuptools wheel | $(QUIET_SATISFIED)
	set -o pipefail; $(VPY) -m pip install --progress-bar off torch==2.13.0 numpy ml_dtypes pytest hypothesis \
		ninja matplotlib 'transformers>=5' safetensors tqdm $(LINT_DEPS) | $(QUIET_SATISFIED)
	touch $(STAMP)

venv: $(STAMP)

# The extension build prints one line per compiled file (ninja's [n/N] counter), not minutes of silence; the
# whole compiler output is kept in build/pip-install.log.
build: venv
	@echo "== building the C++ extension (pip install --no-build-isolation -e .; 2-4 minutes on 2 cores)"
	@mkdir -p build
	set -o pipefail; $(VPY) -m pip install -v --no-build-isolation -e . 2>&1 | tee build/pip-install.log | \
		sed -un -E 's@^ *(\[[0-9]+/[0-9]+\]) .* -c (\S+) .*@  \1 \2@p; s@^(Successfully installed .*)@  \1@p'

test: build lint asan
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q tests

# ruff (lint + format check) over the Python, clang-format over the C++/CUDA; `make format` rewrites in place.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_SOURCES)

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# pack_rows / unpack_rows kernels under AddressSanitizer: a torch-free driver, its own debug build (about a
# second), so a copy one byte too long fails even where no value comparison could see it. Leak checking is
# off: LeakSanitizer needs ptrace, which containers often refuse, and overflows are what this is for.
ASAN_BIN := build/asan/pack_rows_asan
asan:
	@test -f "$$($(CXX) -print-file-name=libasan.so)" || \
		{ echo "make asan: $(CXX) finds no libasan.so (Debian: gcc's libgcc-N-dev provides it)"; exit 1; }
	mkdir -p build/asan
	$(CXX) -std=c++17 -O1 -g -fsanitize=address -fno-omit-frame-pointer -fopenmp -Icsrc \
		tests/asan/pack_rows_asan.cpp -o $(ASAN_BIN)
	ASAN_OPTIONS=detect_leaks=0 ./$(ASAN_BIN)

# Fault injection on the suite itself (slow, not part of `make test`): applies each mutant of tests/mutants.py
# to a scratch copy, rebuilds incrementally, runs the tests that should kill it. MUTATE_ARGS="--only NAME".
# Each mutant: its test selection first, the whole suite (-x) only if it survives that (a mutant the selection
# kills, the whole suite kills too: the selection is a subset). MUTATE_ARGS=--selection-only for a quick pass.
mutate: venv
	MAX_JOBS=1 OMP_NUM_THREADS=$(THREADS) $(VPY) tests/mutate.py $(MUTATE_ARGS)

demo: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m static_moe.demo

bench: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) bench/run_all.py
	mkdir -p docs/img && cp bench/results/*.png docs/img/   # the plots docs/benchmarks.md shows

clean:
	rm -rf build *.egg-info python/static_moe/*.so

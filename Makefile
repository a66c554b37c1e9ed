# One entry point for set-up, tests, the demo and the benchmarks.  Every target is idempotent: it creates
# .venv if missing, installs the pinned dependencies, (re)builds the C++ extension, then does its job.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
THREADS ?= 2

.PHONY: all venv build test asan mutate demo bench clean

all: test

$(STAMP): Makefile   # a changed dependency list re-runs the installs in an existing .venv
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q torch==2.13.0 numpy ml_dtypes pytest hypothesis ninja matplotlib 'transformers>=5'
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(VPY) -m pip install -q --no-build-isolation -e .

test: build asan
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q tests

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
mutate: venv
	MAX_JOBS=1 OMP_NUM_THREADS=$(THREADS) $(VPY) tests/mutate.py $(MUTATE_ARGS)

demo: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m static_moe.demo

bench: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) bench/run_all.py
	mkdir -p docs/img && cp bench/results/*.png docs/img/   # the plots docs/benchmarks.md shows

clean:
	rm -rf build *.egg-info python/static_moe/*.so

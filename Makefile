# One entry point for set-up, tests, the demo and the benchmarks.  Every target is idempotent: it creates
# .venv if missing, installs the pinned dependencies, (re)builds the C++ extension, then does its job.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
THREADS ?= 2

.PHONY: all venv build test demo bench clean

all: test

$(STAMP): Makefile   # a changed dependency list re-runs the installs in an existing .venv
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q torch==2.13.0 numpy ml_dtypes pytest hypothesis ninja matplotlib 'transformers>=5'
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(VPY) -m pip install -q --no-build-isolation -e .

test: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q tests

demo: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m static_moe.demo

bench: build
	OMP_NUM_THREADS=$(THREADS) $(VPY) bench/run_all.py
	mkdir -p docs/img && cp bench/results/*.png docs/img/   # the plots docs/benchmarks.md shows

clean:
	rm -rf build *.egg-info python/static_moe/*.so

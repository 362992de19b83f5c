# Two commands do all the set-up on a fresh clone:
#   make demo   — the main job
#   make test   — the test suite
# Each creates and fills its own virtual environment when it is missing.
#
# JAX=<version> selects the jax/jaxlib release (default: the newest on the index); CI runs the
# suite at both ends of the supported range:  make test JAX=0.8.1
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

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,docs,lint,bench]" $(JAX_PIN)
	@touch $@

demo: $(STAMP)
	$(BIN)/treeattn demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

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
	rm -rf .venv .venv-jax* site

# The two commands of the README: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: setup demo test test-all test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

# parlay's main job on its default: the same GPT, weights and batches on one device, on torch
# (4 gloo ranks), on JAX (explicit and GSPMD) and on the numpy mesh simulator, dp+tp on dp=2,tp=2;
# prints the agreement table and writes out/compare.png.
demo: $(STAMP)
	$(BIN)/parlay compare

test: $(STAMP)
	$(BIN)/python -m pytest

# Everything, the exhaustive checks included (compare on every strategy: ~5 min more here).
test-all: $(STAMP)
	$(BIN)/python -m pytest -m ""

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/redistribute_vs_xla.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

# The whole set-up is two commands:
#
#   make serve   create .venv with what the site needs (the `docs` extra), build the site, serve it on
#                http://127.0.0.1:8000/refimpl/ (a few minutes the first time; it runs no example)
#   make test    add the rest to .venv (the `test`, `browser` and `examples` extras: PyTorch, MPICH,
#                Playwright, Jupyter's kernel), then lint and run the entire test suite
#
# Both need only python3 and make; everything else is installed into .venv from PyPI.
# Both are cheap to repeat: the environment is reinstalled only when pyproject.toml changes, and the
# site is rebuilt only when one of its sources changes. The site shows each worked example from its
# record, the executed notebook examples/NN_slug.ipynb; the tests check every record is current, and
#
#   make records                          re-runs every example in a fresh kernel and rewrites its record
#   make records EXAMPLES="10 61_balance_while_learning"   only those

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# What is installed: the docs extra (for `make serve`), or everything (for `make test`).
DOCS_STAMP := $(VENV)/.installed-docs
TEST_STAMP := $(VENV)/.installed-test
SITE := site
HOST := 127.0.0.1
PORT ?= 8000

# MkDocs 1.x prints a banner about a future version 2; it changes nothing here.
export NO_MKDOCS_2_WARNING := 1
export DISABLE_MKDOCS_2_WARNING := true

# Everything the site is generated from.
SITE_SOURCES := mkdocs.yml pyproject.toml \
	$(shell find docs refimpl examples tests benchmarks -type f \
		-not -path '*/__pycache__/*' -not -name '*.pyc' 2>/dev/null)

.PHONY: all serve test test-variants docs records bench gpu clean distclean venv

all: test

# --- the environment -------------------------------------------------------

# A venv needs pip, which Python brings with its ensurepip module; some system Pythons ship it
# separately (Debian and Ubuntu: the python3-venv package). Without it, say what to install rather than
# fetch pip from a host of our choosing: pip then installs from whatever index your pip is configured for.
$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || { \
		echo "$(PYTHON) cannot make a virtual environment with pip in it: its ensurepip module is missing." >&2; \
		echo "Install your system's venv package (Debian, Ubuntu: apt install python3-venv)," >&2; \
		echo "or point make at another Python: make PYTHON=/path/to/python3.11 ..." >&2; exit 1; }
	@echo "Creating the virtual environment $(VENV)"
	@$(PYTHON) -m venv $(VENV)

# pip says only what goes wrong (`--quiet`); each step prints one line of its own, so that `make serve` shows
# its stages and not pip's hundred lines of what it collected.
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check --progress-bar off

$(DOCS_STAMP): pyproject.toml | $(BIN)/python
	@echo "Installing refimpl and what the site needs (the docs extra) into $(VENV): a minute or two the first time"
	@$(PIP_INSTALL) -e '.[docs]'
	@touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	@echo "Installing refimpl with its test, docs, browser and examples extras into $(VENV)"
	@$(PIP_INSTALL) -e '.[test,docs,browser,examples]'
	@touch $@ $(DOCS_STAMP)

venv: $(TEST_STAMP)

# --- the documentation site ------------------------------------------------

$(SITE)/.built: $(DOCS_STAMP) $(SITE_SOURCES)
	@echo "Building the site into $(SITE)/ (no example is run: each page shows the example's record)"
	@$(BIN)/mkdocs build --strict --site-dir $(SITE)
	@touch $@

docs: $(SITE)/.built

# Served as the host serves it: under the path of site_url (/refimpl/), with 404.html for a missing page.
# Another port: `make serve PORT=8001`.
serve: docs
	@$(BIN)/python docs/serve.py --site $(SITE) --port $(PORT) --bind $(HOST)

# --- tests and benchmarks --------------------------------------------------

# The test files run in JOBS processes (pytest-xdist), each file whole in one of them; JOBS=1 runs them in
# this process, one after another.
JOBS ?= 2
test: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist loadfile)

# The suite again under each setting in which one machine's arithmetic differs from another's: one BLAS
# thread (`make test` uses two), one core, another OpenBLAS kernel, and NumPy without its dispatched vector
# paths. tests/test_settings.py checks in each run that the setting took. VARIANT_TESTS chooses the tests
# (all by default; `make test-variants VARIANT_TESTS="tests/test_notebooks.py tests/test_one_layer.py"`).
VARIANT_TESTS ?= tests
NUMPY_DISPATCH = $(shell $(BIN)/python -c "from numpy._core._multiarray_umath import __cpu_dispatch__ as d; print(' '.join(d))")
test-variants: $(TEST_STAMP)
	OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile $(VARIANT_TESTS)
	REFIMPL_EXPECT_CPUS=1 taskset -c 0 $(BIN)/python -m pytest -q $(VARIANT_TESTS)
	OPENBLAS_CORETYPE=Prescott $(BIN)/python -m pytest -q -n 2 --dist loadfile $(VARIANT_TESTS)
	NPY_DISABLE_CPU_FEATURES="$(NUMPY_DISPATCH)" $(BIN)/python -m pytest -q -n 2 --dist loadfile $(VARIANT_TESTS)

# Re-run the worked examples (all, or those in EXAMPLES) in a fresh Jupyter kernel each, alone in an empty
# folder, and rewrite their records examples/NN_slug.ipynb. Commit the records with the change that made them.
EXAMPLES ?=
records: $(TEST_STAMP)
	$(BIN)/python docs/notebooks.py record --jobs 2 $(EXAMPLES)

bench: $(TEST_STAMP)
	@for script in benchmarks/*.py; do \
		case "$$script" in */_*|*/common.py) continue;; esac; \
		echo "== $$script"; $(BIN)/python "$$script" || exit 1; \
	done

# The GPU check (needs an NVIDIA GPU): add CuPy to .venv, then run every step of benchmarks/gpu.py
# and record its results in docs/benchmarks/gpu.md. CUDA 12 wheels; on a machine without the CUDA
# toolkit, `$(BIN)/pip install 'cupy-cuda12x[ctk]'` first brings the runtime compiler CuPy needs.
gpu: $(TEST_STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[gpu]'
	$(BIN)/python benchmarks/gpu.py --require-gpu

# --- cleaning --------------------------------------------------------------

clean:
	rm -rf $(SITE) .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info

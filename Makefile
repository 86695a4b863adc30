# The whole set-up is two commands:
#
#   make serve   create or refresh .venv, build the documentation site, serve it on http://127.0.0.1:8000
#   make test    create or refresh .venv, then lint and run the entire test suite
#
# Both need only python3 and make; everything else is installed into .venv from PyPI.
# Both are cheap to repeat: the environment is reinstalled only when pyproject.toml changes,
# the site is rebuilt only when one of its sources changes, and worked examples are re-run
# only when their source or the package changes (cached in .cache/examples/).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-from-pyproject
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

.PHONY: all serve test docs bench gpu clean distclean venv

all: test

# --- the environment -------------------------------------------------------

# A Python without ensurepip (Debian's python3 without python3-venv) still gets a
# working venv: create it without pip, then bootstrap pip from its wheel on PyPI.
define BOOTSTRAP_PIP
import hashlib, json, pathlib, subprocess, sys, tempfile, urllib.parse, urllib.request
api = "https://pypi.org/pypi/pip/json"
release = json.load(urllib.request.urlopen(api))
wheel = next(u for u in release["urls"] if u["filename"].endswith(".whl"))
data = urllib.request.urlopen(urllib.parse.urljoin(api, wheel["url"])).read()
assert hashlib.sha256(data).hexdigest() == wheel["digests"]["sha256"], "pip wheel checksum mismatch"
path = pathlib.Path(tempfile.mkdtemp()) / wheel["filename"]
path.write_bytes(data)
subprocess.check_call([sys.executable, str(path / "pip"), "install", "--quiet", str(path)])
endef
export BOOTSTRAP_PIP

$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV) && $(PYTHON) -m venv --without-pip $(VENV) \
		&& $(BIN)/python -c "$$BOOTSTRAP_PIP"; }

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,docs,browser]'
	@touch $@

venv: $(STAMP)

# --- the documentation site ------------------------------------------------

$(SITE)/.built: $(STAMP) $(SITE_SOURCES)
	$(BIN)/mkdocs build --strict --site-dir $(SITE)
	@touch $@

docs: $(SITE)/.built

serve: docs
	@echo "Serving the site on http://$(HOST):$(PORT)/ (Ctrl-C stops it)"
	$(BIN)/python -m http.server $(PORT) --bind $(HOST) --directory $(SITE)

# --- tests and benchmarks --------------------------------------------------

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

bench: $(STAMP)
	@for script in benchmarks/*.py; do \
		case "$$script" in */_*|*/common.py) continue;; esac; \
		echo "== $$script"; $(BIN)/python "$$script" || exit 1; \
	done

# The GPU check (needs an NVIDIA GPU): add CuPy to .venv, then run every step of benchmarks/gpu.py
# and record its results in docs/benchmarks/gpu.md. CUDA 12 wheels; on a machine without the CUDA
# toolkit, `$(BIN)/pip install 'cupy-cuda12x[ctk]'` first brings the runtime compiler CuPy needs.
gpu: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[gpu]'
	$(BIN)/python benchmarks/gpu.py --require-gpu

# --- cleaning --------------------------------------------------------------

clean:
	rm -rf $(SITE) .cache .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) *.egg-info

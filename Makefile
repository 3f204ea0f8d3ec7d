# `make demo` and `make test` work on a fresh machine: they create .venv when missing, install torch
# only when it is absent (then exactly torch==2.13.0, the local CPU build), then the package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	touch $@

$(VENV)/.deps-all: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[all]"
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

demo: $(VENV)/.deps-all
	$(BIN)/ckptzip demo

test: $(VENV)/.deps-all
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) demo-report build *.egg-info src/*.egg-info

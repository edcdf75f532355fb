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

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 \
		-m trainer --config examples/tiny.toml --set train.steps=100

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python bench/step.py --quick

clean:
	rm -rf $(VENV) build *.egg-info

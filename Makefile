# The two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: install sysdeps demo test test-ray soak bench clean

# Re-runs only when pyproject.toml changes. torch is installed first, pinned,
# so that pip never pulls a CUDA build as a dependency of something else.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

install: $(STAMP)

# The system packages the tests need (etcd, prometheus, ip, tmux; python3-venv on Debian), each
# only if its command is missing: installed with apt-get as root, else the command to run is printed.
sysdeps:
	@PYTHON=$(PYTHON) VENV=$(VENV) bash deploy/install-sysdeps.sh

# A local Ray on 127.0.0.1 and ./runs: 2 workers, one killed and replaced, resized to 3,
# suspended, resumed on 2, finished; then a summary table.
demo: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/etrain demo

# Unit, multi-process (gloo), real etcd, S3 (moto) and Prometheus tests: about 10 minutes here.
test: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q -m "not ray and not soak and not slow" tests

# The Ray tier: runs on a multi-node Ray cluster on 127.0.0.1 (tests/test_orchestrator.py,
# tests/test_chaos.py, tests/test_terminal.py, ...), and the few long multi-process tests marked
# slow: about 11 minutes here. CI runs it after `make test`.
test-ray: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q -m "(ray or slow) and not soak" tests

# The chaos soak in its bounded form (1-2 minutes): a worker killed every 10-20 s over 200 steps.
# ETRAIN_SOAK_STEPS=3000 makes it a long soak.
soak: sysdeps $(STAMP)
	ETRAIN_SOAK_STEPS=$${ETRAIN_SOAK_STEPS:-200} $(BIN)/python -m pytest -q -m soak tests

bench: $(STAMP)
	$(BIN)/python bench/step.py --quick

clean:
	rm -rf $(VENV) build *.egg-info

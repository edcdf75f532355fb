# The two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0

.PHONY: install sysdeps demo test test-ray soak test-compat test-exhaustive bench clean

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
	$(BIN)/python -m pytest -q -m "not ray and not soak and not slow and not exhaustive" tests

# The Ray tier: runs on a multi-node Ray cluster on 127.0.0.1 (tests/orchestrator/test_orchestrator.py,
# tests/orchestrator/test_chaos.py, tests/orchestrator/test_terminal.py, ...), and the long multi-process tests marked
# slow: about 30 minutes here. CI runs it after `make test`.
test-ray: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q -m "(ray or slow) and not soak and not exhaustive" tests

# What CI leaves out: the same properties at a larger world (8 ranks), on S3 as well as a local disk, or
# through another entry point (tests marked exhaustive; about 6 minutes here). Run it before a release.
test-exhaustive: sysdeps $(STAMP)
	$(BIN)/python -m pytest -q -m "exhaustive" tests

# The chaos soak in its bounded form (1-2 minutes): a worker killed every 10-20 s over 200 steps.
# ETRAIN_SOAK_STEPS=3000 makes it a long soak.
soak: sysdeps $(STAMP)
	ETRAIN_SOAK_STEPS=$${ETRAIN_SOAK_STEPS:-200} $(BIN)/python -m pytest -q -m soak tests

# The oldest supported torch (pyproject.toml: torch>=2.11,<2.14) in a second venv, .venv-compat: torch 2.11
# on Python 3.12 where there is one (else 3.11), as GPU images ship it. PyPI's torch 2.11 is a CUDA build
# (a few GB with its nvidia packages, downloaded once); it runs on the CPU. Installed as above, torch
# first and named again with the project, so pip cannot swap it for a newer one.
COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-stamp
COMPAT_TORCH := torch==2.11.0
COMPAT_PYTHON ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 python3.11; do \
	$$p -c 'import venv' >/dev/null 2>&1 && { echo $$p; break; }; done)

$(COMPAT_STAMP): pyproject.toml
	@test -n "$(COMPAT_PYTHON)" || { echo "make test-compat needs python3.12 or python3.11 on PATH" >&2; exit 2; }
	test -x $(COMPAT_VENV)/bin/python || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_TORCH)
	$(COMPAT_VENV)/bin/python -m pip install -q -e '.[test,hf]' $(COMPAT_TORCH)
	touch $(COMPAT_STAMP)

# The compatibility subset (tests marked compat: parity layouts ZeRO 1-3, HSDP, TP, PP, expert parallelism;
# save, reshard and resume; the memory tier; HF models; export) on torch 2.11: about 2-4 minutes here (51 tests
# in 3 min 20 s beside another test run), after the first download (about 8 minutes).
test-compat: sysdeps $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c 'import sys, torch; print("torch", torch.__version__, "on Python", sys.version.split()[0])'
	$(COMPAT_VENV)/bin/python -m pytest -q -m "compat and not exhaustive" tests

bench: $(STAMP)
	$(BIN)/python bench/step.py --quick

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info

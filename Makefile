# Two commands for a newcomer: `make demo` (train a small GPT, then sample from it)
# and `make test` (the test suite). Both set up .venv first.
#
# The venv sees the system's packages, so a CUDA build of torch already installed on a
# GPU machine is reused; elsewhere torch==2.13.0 is installed (a CPU wheel where one is
# on disk or on your index).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(PY) examples/demo.py

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info

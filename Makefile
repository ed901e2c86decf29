# Two commands for a newcomer: `make demo` (train a small LLaMA-style model, then sample from it)
# and `make test` (the test suite). Both set up .venv first.
#
# The venv sees the system's packages, so a CUDA build of torch already installed on a
# GPU machine is reused; elsewhere torch==2.13.0 is installed (a CPU wheel where one is
# on disk or on your index).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test flags clean

$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(PY) examples/demo.py

# Post-training on a CPU (docs/post-training.md): SFT, then LoRA and DPO on the SFT model.
sft-demo: setup
	$(PY) examples/sft.py
	$(PY) examples/sft.py --lora
	$(PY) examples/sft.py --dpo

# Two workers (pytest-xdist), each test file on one of them: module fixtures are built once, and
# the suite takes ~7 minutes on two cores where one worker took ~11 (tests/ports.py keeps the
# workers' ports apart). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# docs/flags.md, the flag reference, regenerated from the config dataclasses (a test fails when it is stale).
flags: setup
	$(PY) -m tessera.cli.flag_reference docs/flags.md

clean:
	rm -rf $(VENV) build *.egg-info

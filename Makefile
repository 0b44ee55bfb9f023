# Two commands do all set-up on a fresh machine (Python 3.10+ with venv):
#   make demo   a short LoRA fine-tune of llama-tiny on real text: eager, torch.compile, HF checkpointing and fxmem
#               (hyclora-4bit) side by side: an experiment of the harness, fxmem_bench/, run from this clone
#   make test   the test suite (what CI runs)
# Both create .venv on first use. TORCH pins the torch build: the default is the one CI tests
# (pip takes a local CPU build where one is cached); e.g. make test TORCH=torch==2.11.0 for another.

VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.fxmem-installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -e ".[dev]"
	touch $@

demo: $(STAMP)
	$(VENV)/bin/fxmem bench finetune --workload llama-tiny --steps 40 --preset hyclora-4bit

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --durations=30  # two workers; the slowest tests listed, to keep the suite under 25 minutes

clean:
	rm -rf $(VENV) .pytest_cache

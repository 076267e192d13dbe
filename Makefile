# Two commands on a fresh machine (see README): `make train` and `make test`.
# `make setup` is idempotent: it does nothing when the venv is current.
# `make setup VLLM=1` also installs vLLM (rollout_engine: vllm; scripts/setup_vllm.sh).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
CONFIG ?= default
VLLM   ?= 0

.PHONY: setup train test lint bench clean

setup: $(STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP) scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh $(VENV)
	touch $(VLLM_STAMP)

train: setup
	$(PY) distributed_train.py --config $(CONFIG)

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) benchmark.py --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

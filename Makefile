# Two commands on a fresh machine (see README): `make train` and `make test`.
# `make setup` is idempotent: it does nothing when the venv is current.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= default

.PHONY: setup train test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

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

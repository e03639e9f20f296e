#!/usr/bin/env bash
# AT-GRPO on CPU through verl's main_ppo (see at_grpo_cpu.yaml).
# Usage: [WORKFLOW=relay-v0] [TRAIN_TASKS=64 TEST_TASKS=16] [MODEL_SEED=0] bash recipes/at_grpo_cpu/run.sh [hydra overrides...]
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/at_grpo_cpu): model (model-h128 for cpu_rollout=vllm), data,
# metrics.jsonl, checkpoints, hydra logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
WORKFLOW="${WORKFLOW:-relay-v0}"
RUN_DIR="$(mkdir -p "${VERL_MAS_RUN_DIR:-runs/at_grpo_cpu}" && cd "${VERL_MAS_RUN_DIR:-runs/at_grpo_cpu}" && pwd)"

# A workflow that declares a tailored vocabulary gets a tokenizer with one token per word.
VOCAB=()
if "$PYTHON" -c "import sys; from verl_mas.registry import get_workflow; sys.exit(0 if getattr(get_workflow('$WORKFLOW'), 'vocabulary', None) else 1)"; then
  VOCAB=(--vocab-from "$WORKFLOW")
fi
source "$HERE/../cpu_common.sh"  # MODEL and SHAPE for the selected rollout; the environment below
[ -f "$MODEL/config.json" ] || "$PYTHON" -m verl_mas.tiny --out "$MODEL" --seed "${MODEL_SEED:-0}" "${SHAPE[@]}" "${VOCAB[@]}"
[ -f "$RUN_DIR/data/train.parquet" ] || "$PYTHON" -m verl_mas.data "$WORKFLOW" --out "$RUN_DIR/data" --train "${TRAIN_TASKS:-64}" --test "${TEST_TASKS:-16}" --seed 0

export VERL_FILE_LOGGER_PATH="$RUN_DIR/metrics.jsonl"
ray_env
"$PYTHON" -m verl.trainer.main_ppo --config-path "$HERE" --config-name at_grpo_cpu \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_files="$RUN_DIR/data/train.parquet" data.val_files="$RUN_DIR/data/test.parquet" \
  hydra.run.dir="$RUN_DIR/hydra" trainer.default_local_dir="$RUN_DIR/checkpoints" mas.record.dir="$RUN_DIR/episodes" \
  "${RAY_ENV[@]}" "$@"

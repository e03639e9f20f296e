#!/usr/bin/env bash
# Stock verl GRPO on CPU with verl_mas's cpu platform and hf rollout backend (see grpo_cpu_smoke.yaml).
# Usage: bash recipes/grpo_cpu_smoke/run.sh [hydra overrides...]
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/grpo_cpu_smoke): model (model-h128 for cpu_rollout=vllm), data,
# metrics.jsonl, hydra logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
RUN_DIR="$(mkdir -p "${VERL_MAS_RUN_DIR:-runs/grpo_cpu_smoke}" && cd "${VERL_MAS_RUN_DIR:-runs/grpo_cpu_smoke}" && pwd)"

source "$HERE/../cpu_common.sh"  # MODEL and SHAPE for the selected rollout; the environment below
[ -f "$MODEL/config.json" ] || "$PYTHON" -m verl_mas.tiny --out "$MODEL" "${SHAPE[@]}"
[ -f "$RUN_DIR/data/train.parquet" ] || "$PYTHON" -m verl_mas.demo.digits --out "$RUN_DIR/data"
REWARD_FN="$("$PYTHON" -c 'import verl_mas.demo.digits as m; print(m.__file__)')"

export VERL_FILE_LOGGER_PATH="$RUN_DIR/metrics.jsonl"
ray_env
"$PYTHON" -m verl.trainer.main_ppo --config-path "$HERE" --config-name grpo_cpu_smoke \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_files="$RUN_DIR/data/train.parquet" data.val_files="$RUN_DIR/data/test.parquet" \
  reward.custom_reward_function.path="$REWARD_FN" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "${RAY_ENV[@]}" "$@"

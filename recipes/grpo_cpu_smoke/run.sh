#!/usr/bin/env bash
# Stock verl GRPO on CPU with verl_mas's cpu platform and hf rollout backend (see grpo_cpu_smoke.yaml).
# Usage: bash recipes/grpo_cpu_smoke/run.sh [hydra overrides...]
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/grpo_cpu_smoke): model (model-h128 for cpu_rollout=vllm), data,
# metrics.jsonl, hydra logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
RUN_DIR="$(mkdir -p "${VERL_MAS_RUN_DIR:-runs/grpo_cpu_smoke}" && cd "${VERL_MAS_RUN_DIR:-runs/grpo_cpu_smoke}" && pwd)"

# The tiny model's shape fits the rollout the overrides select: vLLM's CPU attention serves head sizes 32, 64, 80, ...
# only (verl_mas.backends.vllm.support), not the default tiny model's 16 (hidden 64 over 4 heads), so a vLLM rollout
# gets hidden 128 (head size 32), in a directory of its own: a model built for the hf rollout is never reused.
ROLLOUT=hf
for arg in "$@"; do
  case "$arg" in
    cpu_rollout=*|+cpu_rollout=*|++cpu_rollout=*) ROLLOUT="${arg#*cpu_rollout=}" ;;
    actor_rollout_ref.rollout.name=*|+actor_rollout_ref.rollout.name=*|++actor_rollout_ref.rollout.name=*) ROLLOUT="${arg#*=}" ;;
  esac
done
MODEL="$RUN_DIR/model"; SHAPE=()
if [ "$ROLLOUT" = vllm ]; then MODEL="$RUN_DIR/model-h128"; SHAPE=(--hidden-size 128); fi
[ -f "$MODEL/config.json" ] || "$PYTHON" -m verl_mas.tiny --out "$MODEL" "${SHAPE[@]}"
[ -f "$RUN_DIR/data/train.parquet" ] || "$PYTHON" -m verl_mas.demo.digits --out "$RUN_DIR/data"
REWARD_FN="$("$PYTHON" -c 'import verl_mas.demo.digits as m; print(m.__file__)')"

export VERL_PLATFORM=cpu
# TransferQueue's threads: one per physical core (its default of 8 warns hundreds of times on a small machine).
export TQ_NUM_THREADS="${TQ_NUM_THREADS:-$("$PYTHON" -c 'import psutil; print(psutil.cpu_count(logical=False) or 1)')}"
# verl's engine registry warns in every process that the engines of other frameworks are not installed.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::UserWarning:verl.workers.engine}"
# A Ray of its own (ray_kwargs.ray_init.address=local in the yaml), which RAY_ADDRESS would override; to train on a
# cluster, pass ray_kwargs.ray_init.address=<head:port>.
unset RAY_ADDRESS
export VERL_FILE_LOGGER_PATH="$RUN_DIR/metrics.jsonl"
"$PYTHON" -m verl.trainer.main_ppo --config-path "$HERE" --config-name grpo_cpu_smoke \
  actor_rollout_ref.model.path="$MODEL" \
  data.train_files="$RUN_DIR/data/train.parquet" data.val_files="$RUN_DIR/data/test.parquet" \
  reward.custom_reward_function.path="$REWARD_FN" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "$@"

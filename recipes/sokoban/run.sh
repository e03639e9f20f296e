#!/usr/bin/env bash
# AT-GRPO on sokoban-v0 through verl's main_ppo (see sokoban.yaml). GPU node for training; its settings run in CI on CPU with a tiny model (README).
# Usage: MODEL_PATH=/models/Qwen3-1.7B [WORKFLOW=sokoban-v0] bash recipes/sokoban/run.sh [hydra overrides...]
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/sokoban): data and hydra logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
: "${MODEL_PATH:?set MODEL_PATH to a local Qwen3-1.7B checkpoint, the model of the paper}"
WORKFLOW="${WORKFLOW:-sokoban-v0}"
RUN_DIR="$(mkdir -p "${VERL_MAS_RUN_DIR:-runs/sokoban}" && cd "${VERL_MAS_RUN_DIR:-runs/sokoban}" && pwd)"
DATA="$RUN_DIR/data/$WORKFLOW"

[ -f "$DATA/train.parquet" ] || "$PYTHON" -m verl_mas.data "$WORKFLOW" --out "$DATA" \
  --train "${TRAIN_TASKS:-4000}" --test "${TEST_TASKS:-200}" --seed 0

"$PYTHON" -m verl.trainer.main_ppo --config-path "$HERE" --config-name sokoban \
  actor_rollout_ref.model.path="$MODEL_PATH" \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "$@"

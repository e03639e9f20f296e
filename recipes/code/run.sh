#!/usr/bin/env bash
# AT-GRPO on code-v0 through verl's main_ppo (see code.yaml). GPU node for training; its settings run in CI on CPU with a tiny model (README).
# Usage: [WORKFLOW=code-v0] [TRAIN_SOURCE=FILE TRAIN_FORMAT=FMT [TRAIN_START=i TRAIN_STOP=j]]
#        [TEST_SOURCE=FILE TEST_FORMAT=FMT [TEST_START=i TEST_STOP=j]]
#        bash recipes/code/run.sh actor_rollout_ref.model.path=/models/Qwen3-1.7B [hydra overrides...]
# Without TRAIN_SOURCE the project's 16-task set is used (12 train / 4 test): a smoke run, not the paper's.
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/code): data and hydra logs.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
WORKFLOW="${WORKFLOW:-code-v0}"
RUN_DIR="$(mkdir -p "${VERL_MAS_RUN_DIR:-runs/code}" && cd "${VERL_MAS_RUN_DIR:-runs/code}" && pwd)"
DATA="$RUN_DIR/data/$WORKFLOW"

if [ ! -f "$DATA/train.parquet" ]; then
  if [ -n "${TRAIN_SOURCE:-}" ]; then
    "$PYTHON" -m verl_mas.data "$WORKFLOW" --split train --out "$DATA" \
      --source "$TRAIN_SOURCE" --format "$TRAIN_FORMAT" --start "${TRAIN_START:-0}" ${TRAIN_STOP:+--stop "$TRAIN_STOP"}
    "$PYTHON" -m verl_mas.data "$WORKFLOW" --split test --out "$DATA" \
      --source "$TEST_SOURCE" --format "$TEST_FORMAT" --start "${TEST_START:-0}" ${TEST_STOP:+--stop "$TEST_STOP"}
  else
    "$PYTHON" -m verl_mas.data "$WORKFLOW" --out "$DATA" --train 12 --test 4 --seed 0
  fi
fi

"$PYTHON" -m verl.trainer.main_ppo --config-path "$HERE" --config-name code \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  hydra.run.dir="$RUN_DIR/hydra" \
  "$@"

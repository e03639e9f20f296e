#!/usr/bin/env bash
# AT-GRPO on gridwalk-v0 (docs/games.md) through verl's main_ppo on CPU: the CPU quickstart recipe
# (recipes/at_grpo_cpu) with the settings this task learns with on a tiny model from scratch (README.md).
# Usage: [WORKFLOW=gridwalk-v0|gridwalk-single-v0] [MODEL_SEED=0] bash recipes/gridwalk_cpu/run.sh [hydra overrides...]
# Outputs go to $VERL_MAS_RUN_DIR (default: ./runs/gridwalk_cpu), as for recipes/at_grpo_cpu.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export WORKFLOW="${WORKFLOW:-gridwalk-v0}" TRAIN_TASKS="${TRAIN_TASKS:-256}" TEST_TASKS="${TEST_TASKS:-64}"
export VERL_MAS_RUN_DIR="${VERL_MAS_RUN_DIR:-runs/gridwalk_cpu}"
# Shortest paths of 2-6 moves, one move a turn: 6 turns. One token per answer (every move word is one token of the
# tailored tokenizer; a longer answer only adds tokens the parser ignores). lr 1e-3 in 2 mini-batches a step: at
# the quickstart's 3e-3 in 8 the policy turned deterministic on wrong moves within 20-30 steps. Every row trains
# (flat groups included) with an entropy bonus, and 200 steps: with zero-variance groups dropped, or in 100 steps,
# some seeds stall or collapse (README.md). Adam's beta2 0.99 (torch's default 0.999): after a long stretch of flat
# groups the second moment decays to their tiny gradients and one spike then moved a converged policy off its
# answers (seed 1 collapsed at step 175); with 0.99 the second moment follows the gradient scale within ~100 steps
# (docs/algorithm.md, section 4).
exec bash "$HERE/../at_grpo_cpu/run.sh" \
  mas.max_turns=6 data.max_response_length=1 \
  actor_rollout_ref.actor.optim.lr=1e-3 'actor_rollout_ref.actor.optim.betas=[0.9,0.99]' \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 \
  mas.drop_zero_variance=false actor_rollout_ref.actor.entropy_coeff=0.03 \
  trainer.total_training_steps=200 trainer.test_freq=40 trainer.experiment_name=gridwalk_cpu \
  "$@"

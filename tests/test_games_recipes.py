"""The game recipes compose with Hydra against verl's ppo_trainer config and carry a valid ``mas:`` block."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from verl_mas.config import MasConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("name", ["plan_path", "sokoban", "sudoku"])
def test_recipe_composes_with_paper_settings(name: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(RECIPES / name), version_base=None):
        cfg = compose(config_name=name, overrides=["actor_rollout_ref.model.path=/models/Qwen3-1.7B"])
    mas = MasConfig.from_mapping(cfg.mas)
    assert (mas.branching, mas.max_turns, mas.alpha, mas.grouping, mas.sampling) == (4, 4, 1.0, "agent_turn", "tree")
    assert cfg.algorithm.adv_estimator == "at_grpo" and cfg.trainer.v1.trainer_mode == "mas"
    assert cfg.data.train_batch_size == 128 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 64
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.trainer.n_gpus_per_node == 8
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0  # on-policy sampling (docs/algorithm.md §5, pitfall 6)
    # Qwen3 in non-thinking mode, as in the paper: verl's own key, which the mas agent loop renders prompts with.
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    from verl_mas.startup import check_run_config

    check_run_config(cfg)  # the trainer's start-up checks pass (they raise listing every problem)
    assert cfg.actor_rollout_ref.model.path == "/models/Qwen3-1.7B"
    assert OmegaConf.select(cfg, "mas.sandbox.timeout_s") == 10
    # `???` merged over verl's defaults keeps the defaults, so run.sh must pass the model and data paths.
    run_sh = (RECIPES / name / "run.sh").read_text()
    assert run_sh.count("python -m verl.trainer.main_ppo") + run_sh.count('"$PYTHON" -m verl.trainer.main_ppo') == 1
    assert run_sh.rstrip().endswith('"$@"')
    for needed in ('${MODEL_PATH:?', 'actor_rollout_ref.model.path="$MODEL_PATH"', "data.train_files=", "data.val_files="):
        assert needed in run_sh
    assert subprocess.run(["bash", "-n", str(RECIPES / name / "run.sh")], check=False).returncode == 0  # parses

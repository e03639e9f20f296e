"""Drives verl's real FSDP2 actor on the CPU in a child process and reports what it measured as JSON.

Used by ``tests/test_fsdp_actor_cpu.py``. The scenario runs in its own interpreter because it sets
process-wide state that must not leak into other tests: ``VERL_PLATFORM=cpu`` and the torchrun-style
``RANK``/``WORLD_SIZE``/``MASTER_*`` variables read at ``import verl`` and by verl's ``Worker``, and a
global gloo process group that verl's ``TrainingWorker`` initialises and never destroys.

Nothing of verl is mocked. The actor is ``verl.workers.engine_workers.ActorRolloutRefWorker(role="actor")``
built from verl's own Hydra config (``ppo_trainer``), i.e. ``TrainingWorker`` + ``FSDPEngineWithLMHead``
(strategy ``fsdp2``) + ``ppo_loss``, called in-process (one rank, world size 1) exactly the way verl's
trainer calls it through a worker group: ``compute_log_prob`` and ``update_actor`` on no-padding
TensorDicts built with verl's ``left_right_2_no_padding``.

Usage (the test's ``run_scenario`` sets the environment)::

    VERL_PLATFORM=cpu RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
        python tests/_fsdp_helpers.py WORKDIR

writes ``WORKDIR/result.json`` and the tiny model under ``WORKDIR/tiny``, nothing else (Hydra's compose
API creates no run directory, and no Ray is started).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Prompt and response lengths of the four sequences (unequal, so left/right padding is exercised).
PROMPT_LENS = (5, 8, 3, 6)
RESPONSE_LENS = (6, 4, 3, 3)
#: Per-sequence advantages of the PPO update: two rewarded responses, two penalised ones.
ADVANTAGES = (1.0, 1.0, -1.0, -1.0)
#: Learning rate and AdamW betas of the actor (verl's AdamW; weight decay 0 so that a zero gradient
#: leaves the parameters bit-identical, which makes the zero-advantage control exact).
LR = 1e-3
BETAS = (0.9, 0.999)
#: The sampling temperature used for the second parity check (the first uses 1.0).
ALT_TEMPERATURE = 0.7


def actor_overrides(model_path: str, use_remove_padding: bool) -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for a one-rank, full-fp32 FSDP2 actor on the CPU."""
    return [
        f"actor_rollout_ref.model.path={model_path}",
        # verl's default is flash_attention_2, which needs CUDA.
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.model.use_remove_padding={str(use_remove_padding).lower()}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        # Full fp32: weights loaded in fp32 (model_dtype) and FSDP2's MixedPrecisionPolicy kept at fp32
        # for params/reductions/buffers. verl's default without `mixed_precision` is param_dtype bf16
        # (plus a bf16 autocast in forward_step): log-probs then differ from fp32 transformers by ~2e-2.
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        # torch.compile of the entropy kernel would invoke a C++ toolchain on the CPU: slow, not under test.
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.use_torch_compile=false",
        # One mini-batch of all 4 sequences = one optimizer step per update_actor call.
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.optim.betas=[{BETAS[0]},{BETAS[1]}]",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.use_kl_loss=false",
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_rank_env() -> dict[str, str]:
    """The environment of a one-rank torchrun-style gloo group on verl_mas's CPU platform, read when verl is imported
    and by verl's worker (``VERL_PLATFORM=cpu``, ``RANK``/``WORLD_SIZE``/``MASTER_*`` on a free local port)."""
    return dict(VERL_PLATFORM="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def run_scenario(helper: Path, workdir: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run a scenario script (this one, or one built on it) in a child interpreter with ``VERL_PLATFORM=cpu``
    and a one-rank torchrun-style environment (cwd ``workdir``); return the JSON it wrote."""
    env = dict(os.environ)
    env.update(
        **one_rank_env(),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONDONTWRITEBYTECODE="1",  # the helpers live in the checkout: no __pycache__ there
    )
    proc = subprocess.run(
        [sys.executable, str(helper), str(workdir)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    result_file = workdir / "result.json"
    if proc.returncode != 0 or not result_file.exists():
        raise RuntimeError(
            f"the scenario {helper.name} exited with code {proc.returncode}; its output ends "
            f"with:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return json.loads(result_file.read_text())


class FixedBatch:
    """The scenarios' batch: ``len(PROMPT_LENS)`` random sequences in verl's left/right-padded layout (prompts
    left-padded, responses right-padded), turned into verl's no-padding TensorDicts as verl's trainer does."""

    def __init__(self, vocab_size: int, seed: int = 1234) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        bs, max_p, max_r = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
        self.prompts = torch.zeros(bs, max_p, dtype=torch.long)  # pad id 0
        self.responses = torch.zeros(bs, max_r, dtype=torch.long)
        prompt_mask = torch.zeros(bs, max_p, dtype=torch.long)
        self.response_mask = torch.zeros(bs, max_r, dtype=torch.long)
        self.sequences: list[tuple[Any, Any]] = []
        for i, (pl, rl) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
            p = torch.randint(3, vocab_size, (pl,), generator=gen)  # ids 0-2 are special tokens
            r = torch.randint(3, vocab_size, (rl,), generator=gen)
            self.prompts[i, max_p - pl :], prompt_mask[i, max_p - pl :] = p, 1
            self.responses[i, :rl], self.response_mask[i, :rl] = r, 1
            self.sequences.append((p, r))
        self.attention_mask = torch.cat([prompt_mask, self.response_mask], dim=1)
        self.position_ids = (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        self.size, self.max_response = bs, max_r

    def make(self, **fields: Any) -> Any:
        import torch
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = tu.get_tensordict(
            {
                "prompts": self.prompts,
                "responses": self.responses,
                "input_ids": torch.cat([self.prompts, self.responses], dim=1),
                "attention_mask": self.attention_mask,
                "position_ids": self.position_ids,
                "response_mask": self.response_mask.clone(),
                **fields,
            }
        )
        return left_right_2_no_padding(td)

    def verl_log_probs(self, worker: Any, temperature: float = 1.0, **meta: Any) -> Any:
        """(bs, max response length) log-probs from ``worker.compute_log_prob``, zero at padding."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self.make()
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=temperature, **meta)
        out = worker.compute_log_prob(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float() * self.response_mask

    def hf_log_probs(self, model: Any, temperature: float = 1.0) -> Any:
        """The same log-probs from a plain transformers (or peft) model, one unpadded sequence at a time."""
        import torch

        ref = torch.zeros(self.size, self.max_response)
        with torch.no_grad():
            for i, (p, r) in enumerate(self.sequences):
                logits = model(input_ids=torch.cat([p, r])[None]).logits[0].float()  # (pl + rl, vocab)
                # logits at position t predict token t + 1: response token j is predicted at pl - 1 + j
                logp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1] / temperature, dim=-1)
                ref[i, : len(r)] = logp.gather(-1, r[:, None])[:, 0]
        return ref

    def update(self, worker: Any, per_seq_advantage: tuple[float, ...]) -> tuple[Any, Any, dict[str, Any]]:
        """One PPO update through ``worker.update_actor`` with pi_old = the current policy, as verl's trainer
        computes it; returns (log-probs before, after, verl's metrics)."""
        import torch
        from verl.utils import tensordict_utils as tu

        old = self.verl_log_probs(worker)
        advantages = torch.tensor(per_seq_advantage)[:, None] * self.response_mask  # (bs, max_r), GRPO-style
        td = self.make(old_log_probs=old, advantages=advantages)
        # The keys verl's trainer attaches before update_actor (ray_trainer._update_actor).
        tu.assign_non_tensor(
            td,
            calculate_entropy=False,
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=self.size,
            mini_batch_size=self.size,
            epochs=1,
            seed=42,
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
            temperature=1.0,
        )
        metrics = tu.get(worker.update_actor(td), "metrics")
        return old, self.verl_log_probs(worker), metrics


# --------------------------------------------------------------------------------------------------
# The scenario (runs in the child, with the environment set by the test's ``run_scenario``).
# --------------------------------------------------------------------------------------------------


def _scenario(workdir: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    import torch
    import verl  # noqa: F401  (loads the verl_mas plugin: the cpu platform)
    from hydra import compose, initialize_config_module
    from verl.utils.device import get_device_name
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_mas.tiny import write_tiny

    if get_device_name() != "cpu":
        raise RuntimeError(
            f"verl's device is {get_device_name()!r}, not 'cpu': the verl_mas plugin did not register the cpu "
            "platform (is verl_mas installed, and VERL_PLATFORM=cpu set?)."
        )
    timings["import_s"] = time.perf_counter() - t_start

    model_path = write_tiny(workdir / "tiny")
    timings["tiny_model_s"] = time.perf_counter() - t_start - timings["import_s"]

    def build_actor(use_remove_padding: bool) -> ActorRolloutRefWorker:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=actor_overrides(str(model_path), use_remove_padding))
        worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
        worker.init_model()
        return worker

    t = time.perf_counter()
    actor = build_actor(use_remove_padding=True)  # verl's default: sequences packed into one row
    timings["actor_init_s"] = time.perf_counter() - t

    engine = actor.actor.engine
    module = engine.module
    param_dtypes = sorted({str(p.dtype) for p in module.parameters()})
    engine_info = {
        "engine_class": type(engine).__name__,
        "module_class": type(module).__name__,
        "strategy": engine.engine_config.strategy,
        "param_dtypes": param_dtypes,
        "autocast_dtype": str(engine._autocast_dtype),
        "mixed_precision": dict(engine.engine_config.mixed_precision or {}),
        "model_dtype": engine.engine_config.model_dtype,
        "device": get_device_name(),
        "world_size": torch.distributed.get_world_size(),
        "process_group_backend": str(torch.distributed.get_backend()),
        "optimizer": type(engine.optimizer).__name__,
    }

    vocab_size = module.config.vocab_size
    batch = FixedBatch(vocab_size)
    response_mask = batch.response_mask
    verl_log_probs = batch.verl_log_probs

    # ---- the reference: plain transformers, one unpadded sequence at a time, no verl code involved
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def hf_log_probs(temperature: float = 1.0) -> torch.Tensor:
        return batch.hf_log_probs(hf_model, temperature)

    t = time.perf_counter()
    ref_t1, ref_alt = hf_log_probs(1.0), hf_log_probs(ALT_TEMPERATURE)
    got_t1, got_alt = verl_log_probs(actor, 1.0), verl_log_probs(actor, ALT_TEMPERATURE)
    timings["log_probs_s"] = time.perf_counter() - t
    n_tokens = int(response_mask.sum())
    parity = {
        "max_abs_diff": (got_t1 - ref_t1).abs().max().item(),
        "max_abs_diff_alt_temperature": (got_alt - ref_alt).abs().max().item(),
        "alt_temperature": ALT_TEMPERATURE,
        "mean_log_prob": (ref_t1.sum() / n_tokens).item(),
        "min_log_prob": ref_t1[response_mask.bool()].min().item(),
        "max_log_prob": ref_t1[response_mask.bool()].max().item(),
        "n_response_tokens": n_tokens,
        "vocab_size": vocab_size,
        "verl_log_probs": got_t1.tolist(),
        "hf_log_probs": ref_t1.tolist(),
    }

    # ---- PPO updates through verl's update_actor (TrainingWorker.train_mini_batch -> ppo_loss)
    def params() -> dict[str, torch.Tensor]:
        return {n: p.detach().full_tensor().clone() for n, p in module.named_parameters()}

    def ppo_update(per_seq_advantage: tuple[float, ...]) -> dict[str, Any]:
        before = params()
        old, new, metrics = batch.update(actor, per_seq_advantage)
        after = params()
        return {
            "advantages": list(per_seq_advantage),
            "metrics": {k: [float(x) for x in v] for k, v in metrics.items() if not k.startswith("perf/")},
            "seq_log_prob_before": old.sum(dim=1).tolist(),
            "seq_log_prob_after": new.sum(dim=1).tolist(),
            "seq_log_prob_delta": (new.sum(dim=1) - old.sum(dim=1)).tolist(),
            "param_max_abs_delta": {n: (after[n] - before[n]).abs().max().item() for n in before},
        }

    t = time.perf_counter()
    # Order matters for the hand-computed step size in the test: the control runs first, on a fresh
    # AdamW, so the signal update is AdamW's 2nd step after a zero-gradient 1st step.
    control = ppo_update(tuple(0.0 for _ in ADVANTAGES))
    signal = ppo_update(ADVANTAGES)
    timings["updates_s"] = time.perf_counter() - t

    # ---- the padded model-input path (use_remove_padding=false): a second, independent actor
    t = time.perf_counter()
    padded_actor = build_actor(use_remove_padding=False)
    parity["max_abs_diff_padded_inputs"] = (verl_log_probs(padded_actor, 1.0) - ref_t1).abs().max().item()
    timings["padded_actor_s"] = time.perf_counter() - t

    timings["total_s"] = time.perf_counter() - t_start
    return {
        "engine": engine_info,
        "config": {"lr": LR, "betas": list(BETAS), "prompt_lens": PROMPT_LENS, "response_lens": RESPONSE_LENS},
        "parity": parity,
        "control_update": control,
        "ppo_update": signal,
        "timings": timings,
    }


def scenario_main(scenario: Any, argv: list[str]) -> int:
    """A scenario script's entry point: run ``scenario(WORKDIR)`` and write its result to ``WORKDIR/result.json``."""
    workdir = Path(argv[1]).resolve()
    result = scenario(workdir)
    (workdir / "result.json").write_text(json.dumps(result, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(scenario_main(_scenario, sys.argv))

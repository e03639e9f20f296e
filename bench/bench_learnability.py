"""Learnability diagnostic of a workflow with a tailored vocabulary (``relay-v0``, ``gridwalk-v0``): AT-GRPO on
the tiny model, in-process, without verl.

It approximates what the verl quickstart does: the tiny Qwen2 model (2 layers, hidden 64) with the
tokenizer tailored to the workflow's ``vocabulary``, episodes run by the real engine (tree sampling, K
candidates per (task, role, turn), commit the best), group-normalised advantages per group key, and a
PPO-clip policy-gradient update (token-mean) on every trainable candidate. Sampling is plain
temperature-1 sampling from the same model whose log-probs are trained (on-policy).

Three switches put main_ppo's own parts in place of the hand-written ones, one at a time or together, to tell a
difference of algorithm from a difference of pipeline when ``main_ppo`` and this learner disagree:
``--update verl`` runs each update through verl's FSDP2 actor (``ActorRolloutRefWorker(role="actor")`` from
verl's ``ppo_trainer`` config with the CPU recipe's actor settings: fp32, token-packed micro-batches of 2,048
tokens, rows shuffled, AdamW, ``compute_log_prob`` then ``update_actor`` on verl's no-padding TensorDicts) in a
one-rank gloo group of this process, and samples from its gathered weights; ``--sampler engine`` samples with
verl_mas's hf rollout engine (:class:`verl_mas.backends.hf.engine.HFGenerationEngine`, the hf server's), every
candidate its own request and the concurrent episodes' requests batched, left-padded, as in a ``main_ppo`` run;
``--drop-zero-variance`` trains only the groups with signal, in main_ppo's fewer optimiser steps
(``mas.drop_zero_variance``, :func:`verl_mas.minibatch.dropped_rows_steps`). Measured on ``gridwalk-v0``:
docs/algorithm.md §4.

Prints, per step, the team success rate of the training episodes (what verl reports as
``mas/success_rate``), the mean reward per role and the wall time; every ``--eval-every`` steps, the
success of single-sample (K = 1) episodes on the test tasks, where no best-of-K selection helps, sampled at
temperature 1 and greedy.

Usage::

    python bench/bench_learnability.py [--workflow relay-v0 --steps 150 --batch 16 --k 4 --lr 3e-3 --seed 0]
    python bench/bench_learnability.py --workflow gridwalk-v0 --turns 6 --train 256 --test 64
    python bench/bench_learnability.py --workflow gridwalk-v0 --turns 6 --train 256 --test 64 --k 8 --lr 1e-3 \
        --max-new-tokens 1 --steps 100 --eval-every 20 --weight-decay 0.01 --update verl --sampler engine
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl_mas import EpisodeConfig, Sample, get_workflow, run_episode
from verl_mas.advantage.groups import signal_rows
from verl_mas.backends.hf.engine import HFGenerationEngine, SamplingSettings
from verl_mas.data import read_tasks, write_dataset
from verl_mas.minibatch import dropped_rows_steps
from verl_mas.tiny import CHAT_TEMPLATE, build_model, build_tokenizer


class TorchSampler:
    """An ``LLMClient`` sampling K responses of one prompt from a torch causal LM (temperature 1)."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, generator: torch.Generator) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.generator = generator
        #: Greedy decoding (evaluation) instead of temperature-1 sampling.
        self.greedy = False

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], n: int) -> list[Sample]:
        ids = torch.tensor([prompt_ids] * n)
        eos = self.tokenizer.eos_token_id
        out: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        past = None
        step_ids = ids
        for _ in range(self.max_new_tokens):
            res = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits[:, -1].float(), dim=-1)
            if self.greedy:
                tok = logp.argmax(-1, keepdim=True)  # (n, 1)
            else:
                tok = torch.multinomial(logp.exp(), 1, generator=self.generator)  # (n, 1)
            for i in range(n):
                if not done[i]:
                    t = int(tok[i, 0])
                    out[i].append(t)
                    lps[i].append(float(logp[i, t]))
                    done[i] = t == eos
            if all(done):
                break
            step_ids = tok
        return [Sample(token_ids=o, logprobs=lp, stop_reason="completed") for o, lp in zip(out, lps, strict=True)]

    async def generate(self, request: Any) -> list[Sample]:
        return self._sample(list(request.prompt_ids), request.n)


class EngineSampler:
    """An ``LLMClient`` on verl_mas's hf rollout engine: each of a group's K candidates is a request of its own, and
    the requests of concurrent episodes are decoded together (left-padded batches), as the hf server serves them."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, seed: int) -> None:
        self.engine = HFGenerationEngine(model, [tokenizer.eos_token_id], seed=seed)
        self.max_new_tokens = max_new_tokens
        self.greedy = False

    async def generate(self, request: Any) -> list[Sample]:
        settings = SamplingSettings(max_tokens=self.max_new_tokens, temperature=0.0 if self.greedy else 1.0)
        outs = await asyncio.gather(*(self.engine.generate(list(request.prompt_ids), settings)
                                      for _ in range(request.n)))
        return [Sample(token_ids=list(o.token_ids), logprobs=list(o.log_probs), stop_reason=o.stop_reason)
                for o in outs]


class VerlUpdate:
    """The PPO update through verl's FSDP2 actor, with the CPU recipe's actor settings (recipes/at_grpo_cpu), on the
    weights of ``model``, which it refreshes from the actor after every update (the samplers read ``model``)."""

    def __init__(self, model: Any, tokenizer: Any, **settings: Any) -> None:
        """``settings``: the keyword arguments of :meth:`overrides` after the model path."""
        importlib.import_module("verl")  # with VERL_PLATFORM=cpu: verl_mas's cpu platform
        from hydra import compose, initialize_config_module
        from verl.workers.engine_workers import ActorRolloutRefWorker

        with tempfile.TemporaryDirectory(prefix="bench_learnability_actor_") as workdir:
            model.save_pretrained(workdir)
            tokenizer.save_pretrained(workdir)
            with initialize_config_module("verl.trainer.config", version_base=None):
                config = compose("ppo_trainer", overrides=self.overrides(workdir, **settings))
            self.worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
            self.worker.init_model()  # loads the weights from workdir
        self.model = model
        self._pull()

    @staticmethod
    def overrides(model_path: str, *, lr: float, weight_decay: float, clip_grad: float,
                  entropy_coeff: float = 0.0, schedule: str = "constant", min_lr_ratio: float = 0.0,
                  steps: int = -1, beta2: float = 0.999) -> list[str]:
        """verl's ``ppo_trainer`` config with the CPU recipe's actor settings (recipes/at_grpo_cpu/at_grpo_cpu.yaml).

        ``schedule`` is verl's ``actor.optim.lr_scheduler_type``; verl's worker steps it once per ``update_actor``
        call, over ``steps`` calls (main_ppo sets ``optim.total_training_steps`` to the run's steps itself)."""
        return [
            f"actor_rollout_ref.model.path={model_path}",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
            "actor_rollout_ref.actor.use_torch_compile=false",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # each call below names its mini-batch size
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2048",
            "actor_rollout_ref.rollout.n=1",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            f"actor_rollout_ref.actor.optim.weight_decay={weight_decay}",
            f"actor_rollout_ref.actor.optim.betas=[0.9,{beta2}]",
            f"actor_rollout_ref.actor.optim.clip_grad={clip_grad}",
            f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            f"actor_rollout_ref.actor.optim.lr_scheduler_type={schedule}",
            f"actor_rollout_ref.actor.optim.min_lr_ratio={min_lr_ratio}",
            f"actor_rollout_ref.actor.optim.total_training_steps={steps}",
        ]

    def lr(self) -> float:
        """The rate of the actor's next optimiser step."""
        return self.worker.actor.engine.optimizer.param_groups[0]["lr"]

    def _pull(self) -> None:
        module = self.worker.actor.engine.module
        weights = {n: p.detach().full_tensor() for n, p in module.named_parameters()}
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        # verl's module lists a tied lm_head once, as the embedding
        if unexpected or any("lm_head" not in name for name in missing):
            raise RuntimeError(f"verl's actor and the sampling model disagree on parameters: missing {missing}, "
                               f"unexpected {unexpected}")

    @staticmethod
    def _padded(candidates: list[Any]) -> dict[str, torch.Tensor]:
        """verl's padded layout of the rows: prompts left-padded, responses right-padded."""
        rows = len(candidates)
        width_p = max(len(c.prompt_ids) for c in candidates)
        width_r = max(len(c.response_ids) for c in candidates)
        prompts, responses = torch.zeros(rows, width_p, dtype=torch.long), torch.zeros(rows, width_r, dtype=torch.long)
        prompt_mask, response_mask = torch.zeros_like(prompts), torch.zeros_like(responses)
        for i, c in enumerate(candidates):
            p, r = len(c.prompt_ids), len(c.response_ids)
            prompts[i, width_p - p:], prompt_mask[i, width_p - p:] = torch.tensor(c.prompt_ids), 1
            responses[i, :r], response_mask[i, :r] = torch.tensor(c.response_ids), 1
        attention = torch.cat([prompt_mask, response_mask], dim=1)
        return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                "response_mask": response_mask}

    def __call__(self, candidates: list[Any], adv: list[float], minibatches: int) -> tuple[float, float, float]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        # Whole mini-batches, as the mas trainer pads: copies at advantage 0 (a singleton group's).
        extra = -len(candidates) % minibatches
        candidates, adv = candidates + candidates[:extra], list(adv) + [0.0] * extra
        padded = self._padded(candidates)
        response_mask = padded["response_mask"]
        # as verl's trainer: the padded batch converted to no padding for each call, old log-probs first
        td = left_right_2_no_padding(tu.get_tensordict(dict(padded)))
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, temperature=1.0)
        old = no_padding_2_padding(tu.get(self.worker.compute_log_prob(td), "log_probs"), td).float() * response_mask
        advantages = torch.tensor(adv, dtype=torch.float32)[:, None] * response_mask
        td = left_right_2_no_padding(tu.get_tensordict({**padded, "old_log_probs": old, "advantages": advantages}))
        size = len(candidates) // minibatches
        # the keys verl's trainer attaches before update_actor (PPOTrainer._update_actor)
        tu.assign_non_tensor(td, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=size, mini_batch_size=size, epochs=1, seed=42,
                             dataloader_kwargs={"shuffle": True}, compute_loss=True, temperature=1.0)
        metrics = tu.get(self.worker.update_actor(td), "metrics")
        self._pull()
        return (statistics.fmean(metrics["actor/pg_loss"]), statistics.fmean(metrics["grad_norm"]),
                statistics.fmean(metrics["actor/entropy_loss"]))


async def play(
    workflow: type, tasks: list[dict[str, Any]], client: TorchSampler, tokenizer: Any, config: EpisodeConfig, seed: int
) -> list[Any]:
    return list(
        await asyncio.gather(
            *(
                run_episode(workflow, task, client=client, tokenizer=tokenizer, config=config,
                            seed=seed * 1000 + i, task_uid=f"s{seed}t{i}")
                for i, task in enumerate(tasks)
            )
        )
    )


def advantages(candidates: list[Any], eps: float = 1e-6) -> list[float]:
    """GRPO advantages normalised within each group key (docs/algorithm.md §2; unbiased std, as verl)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for c in candidates:
        groups[c.group_key].append(c.reward)
    stats = {
        k: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0) for k, v in groups.items()
    }
    return [(c.reward - stats[c.group_key][0]) / (stats[c.group_key][1] + eps) for c in candidates]


def update(model: Any, optim: torch.optim.Optimizer, candidates: list[Any], adv: list[float], pad_id: int,
           minibatches: int, clip: float = 0.2, clip_grad: float = 1.0,
           entropy_coeff: float = 0.0) -> tuple[float, float, float]:
    """PPO-clip update (token-mean loss) on all candidates, split into ``minibatches`` optimiser steps.

    Returns the mean over mini-batches of the loss, of the gradient norm before clipping (verl's
    ``actor/grad_norm``) and of the policy's entropy over the response tokens (verl's ``actor/entropy``)."""
    order = list(range(len(candidates)))
    random.shuffle(order)
    losses, norms, entropies = [], [], []
    for mb in range(minibatches):
        idx = order[mb::minibatches]
        seqs = [list(candidates[i].prompt_ids) + list(candidates[i].response_ids) for i in idx]
        width = max(map(len, seqs))
        input_ids = torch.full((len(idx), width), pad_id)  # (b, width), right padded
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        resp_mask = torch.zeros((len(idx), width))
        old = torch.zeros((len(idx), width))
        a = torch.zeros((len(idx), 1))
        for row, (i, s) in enumerate(zip(idx, seqs, strict=True)):
            c = candidates[i]
            p, r = len(c.prompt_ids), len(c.response_ids)
            input_ids[row, : len(s)] = torch.tensor(s)
            attn[row, : len(s)] = 1
            resp_mask[row, p : p + r] = 1  # position t holds token t: predicted from logits at t - 1
            old[row, p : p + r] = torch.tensor(c.logprobs)
            a[row, 0] = adv[i]
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1].float()  # (b, width - 1, V)
        all_logp = torch.log_softmax(logits, -1)
        logp = all_logp.gather(-1, input_ids[:, 1:, None])[..., 0]  # (b, width - 1)
        mask, old = resp_mask[:, 1:], old[:, 1:]
        entropy = -(all_logp.exp() * all_logp).sum(-1)  # (b, width - 1)
        entropies.append(float((entropy.detach() * mask).sum() / mask.sum()))
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
        loss = -((surrogate + entropy_coeff * entropy) * mask).sum() / mask.sum()  # token-mean, entropy bonus
        optim.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)))
        optim.step()
        losses.append(float(loss.detach()))
    return statistics.fmean(losses), statistics.fmean(norms), statistics.fmean(entropies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workflow", default="relay-v0", help="a workflow id whose class declares a vocabulary")
    parser.add_argument("--train", type=int, default=64, help="training tasks")
    parser.add_argument("--test", type=int, default=16, help="held-out tasks")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16, help="tasks per step")
    parser.add_argument("--k", type=int, default=4, help="candidates per group")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--minibatches", type=int, default=2, help="PPO mini-batches per step")
    parser.add_argument("--weight-decay", type=float, default=0.0,
                        help="AdamW's decoupled weight decay (verl's actor default: 0.01); 0: plain Adam")
    parser.add_argument("--beta2", type=float, default=0.999,
                        help="Adam's second-moment decay (verl's actor.optim.betas[1]: 0.999); lower forgets the "
                             "gradient scale of a long flat stretch sooner")
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="the gradient-norm clip before each optimiser step (verl's actor.optim.clip_grad: 1.0)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="verl's actor.optim.lr_scheduler_type, stepped once a training step over --steps (the CPU "
                             "recipes': constant)")
    parser.add_argument("--min-lr-ratio", type=float, default=0.0,
                        help="with --lr-schedule cosine: the last step's rate over --lr (verl's optim.min_lr_ratio)")
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--entropy-coeff", type=float, default=0.0,
                        help="the entropy bonus in the loss (verl's actor.entropy_coeff; recipes/at_grpo_cpu's: 0, "
                             "recipes/gridwalk_cpu's: 0.03)")
    parser.add_argument("--drop-zero-variance", action="store_true",
                        help="train only the rows of groups whose rewards differ in ceil(minibatches x kept / all rows) "
                             "mini-batches, as main_ppo's mas.drop_zero_variance (the recipes' default) does "
                             "(verl_mas.minibatch.dropped_rows_steps); without it every candidate trains")
    parser.add_argument("--drop-keeps-steps", action="store_true",
                        help="with --drop-zero-variance: split the kept rows into --minibatches mini-batches still")
    parser.add_argument("--update", choices=("torch", "verl"), default="torch",
                        help="the PPO update: the hand-written one below, or verl's FSDP2 actor's")
    parser.add_argument("--sampler", choices=("torch", "engine"), default="torch",
                        help="sampling: a plain KV-cached loop, or verl_mas's hf rollout engine (the hf server's)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this model size)")
    parser.add_argument("--chat", choices=("compact", "chatml"), default="compact",
                        help="the tailored tokenizer's chat layout: its compact default or ChatML (10-token prompts)")
    parser.add_argument("--save", type=Path, default=None,
                        help="write the trained model and its tokenizer there after the last step (a model folder "
                             "the CPU recipes and python -m verl_mas.evaluate load)")
    args = parser.parse_args()
    if args.min_lr_ratio and args.lr_schedule != "cosine":
        parser.error("--min-lr-ratio sets where the cosine schedule ends; a constant rate has none: add "
                     "--lr-schedule cosine or drop --min-lr-ratio")
    if args.update == "verl":  # a one-rank gloo group in this process, set before verl is imported
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' scenario helpers
        from _fsdp_helpers import one_rank_env

        os.environ.update(one_rank_env())
    torch.set_num_threads(args.threads)
    random.seed(args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        train_path, test_path = write_dataset(args.workflow, tmp, train=args.train, test=args.test, seed=args.seed)
        train_tasks, test_tasks = read_tasks(train_path), read_tasks(test_path)
    workflow = get_workflow(args.workflow)
    tokenizer = build_tokenizer(vocab=workflow.vocabulary,
                                chat_template=CHAT_TEMPLATE if args.chat == "chatml" else None)
    model = build_model(tokenizer, seed=args.seed)
    if args.update == "verl":
        step_update = VerlUpdate(model, tokenizer, lr=args.lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, entropy_coeff=args.entropy_coeff,
                                 schedule=args.lr_schedule, min_lr_ratio=args.min_lr_ratio, steps=args.steps,
                                 beta2=args.beta2)
        current_lr = step_update.lr
    else:
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        betas = (0.9, args.beta2)
        optim = (torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=betas)
                 if args.weight_decay else torch.optim.Adam(model.parameters(), lr=args.lr, betas=betas))
        # verl's schedules, stepped as verl's worker steps them: once a training step
        scheduler = (get_cosine_schedule_with_warmup(optim, 0, args.steps, min_lr_ratio=args.min_lr_ratio)
                     if args.lr_schedule == "cosine" else get_constant_schedule_with_warmup(optim, 0))

        def step_update(cands: list[Any], adv: list[float], minibatches: int) -> tuple[float, float, float]:
            result = update(model, optim, cands, adv, tokenizer.pad_token_id, minibatches, clip_grad=args.clip_grad,
                            entropy_coeff=args.entropy_coeff)
            scheduler.step()
            return result

        def current_lr() -> float:
            return optim.param_groups[0]["lr"]
    gen = torch.Generator().manual_seed(args.seed)
    client: TorchSampler | EngineSampler = (
        EngineSampler(model, tokenizer, args.max_new_tokens, args.seed) if args.sampler == "engine"
        else TorchSampler(model, tokenizer, args.max_new_tokens, gen))
    config = EpisodeConfig(branching=args.k, max_turns=args.turns)
    eval_config = EpisodeConfig(branching=1, max_turns=args.turns)
    print(f"vocab {len(tokenizer)} tokens, {sum(p.numel() for p in model.parameters())} parameters, "
          f"K={args.k} T={args.turns} batch={args.batch} lr={args.lr} ({args.lr_schedule}"
          + (f" to {args.min_lr_ratio:g}x" if args.lr_schedule == "cosine" else "")
          + f") entropy_coeff={args.entropy_coeff}, update: {args.update}, sampler: {args.sampler}")

    def evaluate(step: int) -> None:
        model.eval()
        sampled = asyncio.run(play(workflow, test_tasks, client, tokenizer, eval_config, seed=10_000 + step))
        client.greedy = True
        greedy = asyncio.run(play(workflow, test_tasks, client, tokenizer, eval_config, seed=10_000 + step))
        client.greedy = False
        model.train()
        rate = {name: statistics.fmean(e.metrics["mas/success"] for e in eps) for name, eps in
                (("sampled", sampled), ("greedy", greedy))}
        print(f"  eval step {step:3d}: K=1 test success, sampled {rate['sampled']:.2f} greedy {rate['greedy']:.2f}")

    rng = random.Random(args.seed)
    start = time.perf_counter()
    history: list[tuple[float, float]] = []  # (success, elapsed s) per step
    evaluate(0)
    for step in range(1, args.steps + 1):
        batch = rng.sample(train_tasks, args.batch)
        model.eval()
        episodes = asyncio.run(play(workflow, batch, client, tokenizer, config, seed=step))
        model.train()
        cands = [c for e in episodes for c in e.trainable()]
        adv = advantages(cands)
        trained, trained_adv, minibatches = cands, adv, args.minibatches
        if args.drop_zero_variance:
            # the trainer's rule (verl_mas.trainer.rows_to_drop): the rows whose group-normalised advantage can be non-zero
            _, ids = np.unique([c.group_key for c in cands], return_inverse=True)
            kept = np.flatnonzero(signal_rows(ids, np.array([c.reward for c in cands]))).tolist()
            trained, trained_adv = [cands[i] for i in kept], [adv[i] for i in kept]
            if kept and not args.drop_keeps_steps:
                minibatches = dropped_rows_steps(args.minibatches, len(kept), len(cands))
        # as main_ppo: no optimiser step without a row to train
        nan, lr = float("nan"), current_lr()
        loss, grad_norm, entropy = step_update(trained, trained_adv, minibatches) if trained else (nan, nan, nan)
        success = statistics.fmean(e.metrics["mas/success"] for e in episodes)
        by_role = {
            role: statistics.fmean([c.reward for c in cands if c.role == role] or [0.0]) for role in workflow.roles
        }
        zero_std = statistics.fmean(
            len({c.reward for c in g.all}) == 1 for e in episodes for g in e.groups
        )
        elapsed = time.perf_counter() - start
        history.append((success, elapsed))
        print(f"step {step:3d}  success {success:.2f}  " + "  ".join(f"{r} {v:.2f}" for r, v in by_role.items()) + "  "
              f"zero-std groups {zero_std:.2f}  loss {loss:+.3f}  grad norm {grad_norm:.2f}  entropy {entropy:.2f}  "
              f"lr {lr:.1e}  "
              f"{elapsed:6.1f}s", flush=True)
        if step % args.eval_every == 0:
            evaluate(step)
    # 16 episodes per step make single steps noisy: summarise with 10-step windows.
    window = 10
    print(f"training success, mean over {window}-step windows:")
    reached = None
    for lo in range(0, len(history), window):
        chunk = history[lo : lo + window]
        mean = statistics.fmean(s for s, _ in chunk)
        print(f"  steps {lo + 1:3d}-{lo + len(chunk):3d}: {mean:.2f}  (at {chunk[-1][1]:.0f}s)")
        if reached is None and mean >= 0.6:
            reached = (lo + len(chunk), chunk[-1][1])
    print("first window with mean success >= 0.6 ends at: "
          + (f"step {reached[0]}, {reached[1]:.0f}s" if reached else "never"))
    if args.save is not None:
        model.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)
        print(f"trained model written to {args.save}")


if __name__ == "__main__":
    main()

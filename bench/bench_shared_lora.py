"""Benchmark: one resident base + N LoRA adapters vs one stack per adapter, for N = 2 and 4 roles.

For each N, in one process on the CPU (verl's real FSDP2 actor, one rank):

- shared: one ``SharedBaseLoraWorker`` (verl's ``ActorRolloutRefWorker`` holding the base once and N adapters,
  :mod:`verl_mas.policies.lora_worker`) and one hf rollout engine serving the N adapters;
- stacks: N verl ``ActorRolloutRefWorker`` with one LoRA adapter each (verl's own LoRA, today's
  ``mas.lora_base=per_policy``) and N hf rollout engines.

Printed per configuration: resident parameter bytes of the actor side and of the rollout side, their ratio to
a single stack's (actor: one base + one adapter; rollout: one base, as a merged-weights rollout holds it), and the time of one "step" (for every adapter: log-probs and one
PPO update on the same 4-sequence batch; median of the rounds), with the ratio shared / stacks.

What the numbers mean: resident bytes of a shared base are base + N adapters, so their ratio to one stack is
1 + (N - 1) x adapter / (base + adapter): it depends on how large an adapter is next to its base, which the
script prints. The default model (hidden 1024, 2 layers, rank 8 on every linear layer) puts an adapter at
~1.1 % of the base; a 1B model with rank-8 adapters is nearer 0.5 %. Step time on 2 shared cores is
dominated by the per-adapter forward/backward passes, which both configurations run alike.

Usage (about a minute on 2 cores):
    python bench/bench_shared_lora.py [--hidden 1024] [--layers 2] [--rank 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


sys.path.insert(0, str(REPO / "tests"))  # the tests' scenario helpers: verl's actor config and batch
from _fsdp_helpers import one_rank_env  # noqa: E402  (defines functions only)

# One rank, torchrun-style, verl on the CPU platform (set before verl is imported).
os.environ.update(**one_rank_env(), TOKENIZERS_PARALLELISM="false")

ADVANTAGES = (1.0, 1.0, -1.0, -1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--roles", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()

    import torch
    import verl  # noqa: F401  (the verl_mas plugin: cpu platform)
    from _fsdp_helpers import FixedBatch, actor_overrides
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_mas.backends.hf.engine import HFGenerationEngine
    from verl_mas.policies.adapters import ADAPTERS_KEY, tensors_by_adapter
    from verl_mas.policies.lora_worker import SharedBaseLoraWorker
    from verl_mas.tiny import write_tiny

    work = Path(tempfile.mkdtemp(prefix="verl_mas_bench_shared_lora_"))
    model = write_tiny(work / "model", hidden_size=args.hidden, num_hidden_layers=args.layers,
                       intermediate_size=2 * args.hidden, num_attention_heads=8, num_key_value_heads=4)

    def config(plan: dict | None) -> object:
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=[
                *actor_overrides(str(model), use_remove_padding=True),
                f"actor_rollout_ref.model.lora_rank={args.rank}", f"actor_rollout_ref.model.lora_alpha={2 * args.rank}",
                "actor_rollout_ref.model.target_modules=all-linear",
            ])
        if plan is not None:
            with open_dict(cfg):
                cfg.actor_rollout_ref.rollout.custom = {ADAPTERS_KEY: plan}
        return cfg.actor_rollout_ref

    def param_bytes(module: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def timed_step(workers_and_adapters: list[tuple[object, str | None]], batch: FixedBatch) -> float:
        start = time.perf_counter()
        for worker, adapter in workers_and_adapters:
            if adapter is not None:
                worker.mas_set_adapter(adapter)
            batch.update(worker, ADVANTAGES)
        return time.perf_counter() - start

    rows = []
    single = None
    for n in args.roles:
        names = [f"role{i}" for i in range(n)]
        plan = {p: {"rank": args.rank, "alpha": 2 * args.rank, "optim": {}} for p in names}
        # ---- shared: one worker, one rollout
        shared = SharedBaseLoraWorker(config=config(plan), role="actor")
        shared.init_model()
        batch = FixedBatch(shared.actor.engine.module.config.vocab_size)
        actor_shared = shared.mas_adapter_report()["resident_param_bytes"]
        tensors, peft_config = shared.actor.engine.get_per_tensor_param(base_sync_done=True)
        by_adapter = tensors_by_adapter(tensors, names, prepare=lambda t: t.detach().cpu())
        rollout = HFGenerationEngine.from_pretrained(str(model))
        rollout.load_adapters(by_adapter, peft_config[ADAPTERS_KEY])
        rollout_shared = param_bytes(rollout.model)
        adapter_bytes = sum(t.numel() * t.element_size() for t in by_adapter[names[0]].values())
        timed_step([(shared, p) for p in names], batch)  # warm-up
        t_shared = statistics.median(timed_step([(shared, p) for p in names], batch) for _ in range(args.rounds))
        del shared, rollout
        # ---- stacks: one verl LoRA worker and one (merged-weights) rollout per adapter
        stacks = []
        for _ in names:
            worker = ActorRolloutRefWorker(config=config(None), role="actor")
            worker.init_model()
            stacks.append(worker)
        actor_stacks = sum(param_bytes(w.actor.engine.module) for w in stacks)
        one_stack = param_bytes(stacks[0].actor.engine.module)
        rollout_one = param_bytes(HFGenerationEngine.from_pretrained(str(model)).model)  # merged weights: the base
        rollout_stacks = n * rollout_one
        timed_step([(w, None) for w in stacks], batch)
        t_stacks = statistics.median(timed_step([(w, None) for w in stacks], batch) for _ in range(args.rounds))
        del stacks
        single = one_stack if single is None else single
        rows.append((n, "shared base", actor_shared, rollout_shared, t_shared, adapter_bytes, rollout_one))
        rows.append((n, "stack per adapter", actor_stacks, rollout_stacks, t_stacks, adapter_bytes, rollout_one))

    base_bytes = single - rows[0][5]
    print(f"model: hidden {args.hidden}, {args.layers} layers; base {base_bytes / 2**20:.2f} MiB, one rank-{args.rank} "
          f"adapter {rows[0][5] / 2**20:.3f} MiB ({100 * rows[0][5] / base_bytes:.2f} % of the base); single stack "
          f"(base + 1 adapter) {single / 2**20:.2f} MiB")
    print(f"{'N':>2} | {'config':>17} | {'actor MiB':>9} | {'x single':>8} | {'rollout MiB':>11} | {'x single':>8} | "
          f"{'step s':>7} | {'x stacks':>8}")
    for i, (n, name, actor, rollout_bytes, seconds, _, rollout_one) in enumerate(rows):
        stacks_time = rows[i + 1][4] if name == "shared base" else seconds
        print(f"{n:>2} | {name:>17} | {actor / 2**20:9.2f} | {actor / single:8.3f} | {rollout_bytes / 2**20:11.2f} | "
              f"{rollout_bytes / rollout_one:8.3f} | {seconds:7.3f} | {seconds / stacks_time:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

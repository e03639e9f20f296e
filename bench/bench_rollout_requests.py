"""Benchmark: a group of K as one request of K samples vs K single-sample requests, on the hf backend's Ray server.

What ``main_ppo``'s rollout does on the ``hf`` backend, without the trainer: the mas agent loop's client
(:class:`verl_mas.agent_loop.VerlServerClient`) over verl's own server client (``SessionRoutedClient``, verl's
``LLMServerClient`` with the session routing key) and verl's ``GlobalRequestLoadBalancer`` actor, against one real
:class:`~verl_mas.backends.hf.server.HFRolloutServer` actor serving a tiny model. ``--episodes`` concurrent episodes
each ask ``--groups`` groups of ``--k`` one after the other (gridwalk-v0's shape by default: 16 tasks, 6 turns x 2
roles, K=8, one answer token, a 40-token prompt). Printed, as the median of ``--repeats`` alternating runs: the wall
time per step's worth of groups for

- ``per candidate``: K requests per group (verl's contract: an acquire on the load balancer, a generate, a release
  for each sample; what vLLM gets);
- ``per group``: one request of K samples (``mas_samples``, what the hf backend gets);
- ``engine only``: the same groups on the generation engine in this process (no Ray): the floor.

Measured 2026-12-04 (2 shared cores, a main_ppo training run beside it, so the figures are high and noisy; the ratio
is the point; median of 5): per candidate 6.48 s (237 samples/s), per group 2.73 s (562 samples/s), engine only
0.49 s: one request per group is x2.4 faster; it is still x5.6 the engine's floor (Ray's round trips, and batches
that form from fewer requests at a time in the server than in one process). In gridwalk-v0's main_ppo run,
``timing_s/gen`` was ~5 s of a ~13.5 s step with per-candidate requests.

Usage (about a minute)::

    python bench/bench_rollout_requests.py [--repeats 5] [--episodes 16 --groups 12 --k 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--groups", type=int, default=12, help="groups per episode, asked one after the other")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import ray
    import torch
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    from verl_mas.agent_loop import VerlServerClient
    from verl_mas.backends.hf.engine import HFGenerationEngine, settings_from_verl
    from verl_mas.backends.hf.server import HFRolloutServer
    from verl_mas.client import GenerateRequest
    from verl_mas.routing import SessionRoutedClient
    from verl_mas.tiny import main as make_tiny

    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    prompt = list(range(5, 5 + args.prompt_tokens))
    samples = args.episodes * args.groups * args.k

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        make_tiny(["--out", str(model_dir), "--vocab-from", "gridwalk-v0"])

        class ModelConfig:
            path = local_path = str(model_dir)
            trust_remote_code = False

        async def drive(ask) -> float:
            async def episode(e: int) -> None:
                for g in range(args.groups):
                    await ask(e, g)

            start = time.perf_counter()
            await asyncio.gather(*(episode(e) for e in range(args.episodes)))
            return time.perf_counter() - start

        def request(e: int, g: int) -> GenerateRequest:
            return GenerateRequest(role="walker", prompt_ids=prompt, n=args.k, group_key=f"task{e}|walker|{g}",
                                   session_id=f"task{e}|walker|0", seed=0)

        engine = HFGenerationEngine.from_pretrained(str(model_dir), seed=0)
        settings = settings_from_verl(params, prompt_len=len(prompt), response_length=1, prompt_length=512,
                                      max_model_len=513)

        async def engine_only(e: int, g: int) -> None:
            await asyncio.gather(*(engine.generate(prompt, settings) for _ in range(args.k)))

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        try:
            config = RolloutConfig(name="hf", prompt_length=512, response_length=1, tensor_model_parallel_size=1)
            server = ray.remote(HFRolloutServer).options(max_concurrency=1000).remote(config, ModelConfig(), 0)
            balancer = ray.remote(GlobalRequestLoadBalancer).remote({"hf-replica-0:0": server})
            manager = SessionRoutedClient(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf"}}}),
                                          load_balancer_handle=balancer)
            clients = {"per candidate": VerlServerClient(manager, params, grouped=False),
                       "per group": VerlServerClient(manager, params, grouped=True)}
            modes = {name: (lambda c: lambda e, g: c.generate(request(e, g)))(client) for name, client in clients.items()}
            modes["engine only"] = engine_only
            for ask in modes.values():  # warm-up: model load, first batches
                asyncio.run(drive(ask))
            times: dict[str, list[float]] = {name: [] for name in modes}
            for _ in range(args.repeats):
                for name, ask in modes.items():
                    times[name].append(asyncio.run(drive(ask)))
            stats = ray.get(server.stats.remote())
        finally:
            ray.shutdown()

    print(f"{args.episodes} episodes x {args.groups} groups x K={args.k} = {samples} samples of 1 token, "
          f"{args.prompt_tokens}-token prompt; {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
          f"median of {args.repeats}")
    medians = {name: statistics.median(v) for name, v in times.items()}
    for name, m in medians.items():
        print(f"  {name:14s} {m:6.2f} s  ({samples / m:7.0f} samples/s)  runs: "
              + " ".join(f"{t:.2f}" for t in times[name]))
    print(f"  per candidate / per group: x{medians['per candidate'] / medians['per group']:.2f}; "
          f"per group / engine only: x{medians['per group'] / medians['engine only']:.2f}")
    print(f"  server counted {stats['requests']} requests, {stats['samples']} samples")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Evaluate a model (a trained checkpoint or any local transformers model) on a test split of a workflow.

Runs one episode per task of a parquet split written by ``python -m verl_mas.data`` with a local
``transformers`` model (CPU is fine for small models), greedy by default, and reports the success rate per
dataset (``data_source``) and the mean of every per-role / per-episode metric::

    python -m verl_mas.evaluate --data runs/quickstart/data/test.parquet --model runs/quickstart/model
    python -m verl_mas.evaluate --data test.parquet --model ckpt/hf --branching 1 --temperature 0 --json out.json

Any model may serve any role (``--role ROLE=MODEL``, repeatable; unlisted roles use ``--model``), so the
paper's role-swap ablation of a per-role run is one command::

    python -m verl_mas.evaluate --data test.parquet \
        --role caller=CKPT/global_step_N/actor_runner/huggingface --role runner=CKPT/global_step_N/actor/huggingface

A verl checkpoint saved with ``actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]`` has a
transformers directory in ``actor*/huggingface``. A PEFT adapter directory (per-role LoRA on a shared base
saves each role's in ``actor/adapters/<policy>``) serves merged onto its base (``--base``, else the one its
``adapter_config.json`` names). Otherwise convert a checkpoint with verl's merger (``python -m verl.model_merger merge --backend fsdp --local_dir CKPT/actor --target_dir OUT``). For
served models, build an :class:`verl_mas.LLMClient` and call :func:`evaluate`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_mas.client import GenerateRequest, LLMClient, Sample
from verl_mas.engine import run_episode
from verl_mas.settings import EpisodeConfig

# verl_mas.routing imports verl, which warns a dozen times at import: main() imports it after parsing the
# arguments, so that `--help` and argument errors print only what they are about.

logger = logging.getLogger(__name__)

__all__ = ["LocalModelClient", "evaluate", "main"]


class LocalModelClient:
    """:class:`verl_mas.LLMClient` over a local transformers model (the hf backend's batched engine)."""

    def __init__(self, model_path: str, *, temperature: float = 0.0, max_tokens: int = 256, seed: int = 0,
                 adapter: str | None = None) -> None:
        from verl_mas.backends.hf.engine import HFGenerationEngine, SamplingSettings

        self.engine = HFGenerationEngine.from_pretrained(model_path, seed=seed)
        if adapter is not None:  # a PEFT adapter (e.g. a shared-base checkpoint's actor/adapters/<policy>) merged in
            from peft import PeftModel

            self.engine.model = PeftModel.from_pretrained(self.engine.model, adapter).merge_and_unload().eval()
        self._settings = SamplingSettings(max_tokens=max_tokens, temperature=temperature)

    async def generate(self, request: GenerateRequest) -> list[Sample]:
        results = await asyncio.gather(*(self.engine.generate(request.prompt_ids, self._settings) for _ in range(request.n)))
        return [Sample(token_ids=r.token_ids, logprobs=r.log_probs, stop_reason=r.stop_reason) for r in results]


def parse_role_models(specs: Sequence[str]) -> dict[str, str]:
    """``["caller=DIR", ...]`` -> ``{"caller": "DIR"}``; every malformed or repeated spec is reported."""
    out: dict[str, str] = {}
    problems = []
    for spec in specs:
        role, sep, path = spec.partition("=")
        if not sep or not role or not path:
            problems.append(f"--role {spec!r}: use ROLE=MODEL_DIR, e.g. --role caller=ckpt/actor/huggingface")
        elif role in out:
            problems.append(f"--role {role} is given twice ({out[role]!r} and {path!r})")
        else:
            out[role] = path
    if problems:
        raise SystemExit("python -m verl_mas.evaluate: " + "; ".join(problems))
    return out


def model_source(path: str, base: str | None) -> tuple[str, str | None]:
    """``(model directory, adapter directory or None)`` of a ``--model``/``--role`` directory.

    A directory holding ``adapter_config.json`` is a PEFT adapter: it is served merged onto ``--base``, else
    onto the base its config names (``base_model_name_or_path``, the model the adapter was trained on).
    """
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return path, None
    named = json.loads(config.read_text()).get("base_model_name_or_path")
    model = base or named
    if not model or not (Path(model) / "config.json").is_file():
        raise SystemExit(
            f"python -m verl_mas.evaluate: {path} is a LoRA adapter whose base model {model!r} is not a local model "
            "directory; pass the base it was trained on with --base DIR."
        )
    return model, path


def model_tokenizers(paths: Sequence[str]) -> dict[str, Any]:
    """``{model directory: its tokenizer}``, each checked to fit its model (models may differ in vocabulary:
    each role renders and decodes with its own model's tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    from verl_mas.routing import tokenizer_fit_problems

    paths = list(dict.fromkeys(paths))
    tokenizers = {path: AutoTokenizer.from_pretrained(path) for path in paths}
    problems = tokenizer_fit_problems(tokenizers, {p: AutoConfig.from_pretrained(p).vocab_size for p in paths})
    if problems:
        raise SystemExit("python -m verl_mas.evaluate: " + " ".join(problems))
    return tokenizers


async def evaluate(
    rows: list[dict[str, Any]], *, client: LLMClient, tokenizer: Any, config: EpisodeConfig, seed: int = 0,
    records: list[dict[str, Any]] | None = None, policies: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Run one episode per row (concurrently) and aggregate success and metrics.

    Args:
        rows: Dataset rows as written by ``python -m verl_mas.data`` (``data_source``, ``extra_info``).
        client: Serves every role (one model for all roles; a :class:`verl_mas.routing.RoleRoutedClient` for several).
        tokenizer: Renders prompts with its chat template and decodes answers (a ``{role: tokenizer}`` mapping,
            e.g. :meth:`verl_mas.routing.RoleRouter.tokenizers`, when the roles' models differ in vocabulary).
        config: Branching, turns, alpha (use ``branching=1`` for single-sample accuracy).
        records: If given, every episode's viewing record (:func:`verl_mas.recording.episode_record`) is
            appended to it, in row order.
        policies: ``{role: model}`` for the records.

    Returns:
        ``success_rate/<data_source>``, ``success_rate`` (all rows; an episode aborted by an infrastructure
        failure counts as a failure), ``aborted_rate`` and the mean of every ``mas/*`` metric.
    """

    async def one(i: int, row: dict[str, Any]) -> tuple[str, dict[str, float]]:
        extra = row["extra_info"]
        task = json.loads(extra["task"]) if isinstance(extra["task"], str) else extra["task"]
        episode = await run_episode(
            extra["workflow"], task, client=client, tokenizer=tokenizer, config=config, seed=seed + i,
            task_uid=f"eval-{i}",
        )
        metrics = dict(episode.metrics)
        if episode.aborted:
            metrics["mas/success"] = 0.0  # never left out of the rate: a failure, counted in aborted_rate
        if records is not None:
            from verl_mas.recording import episode_record

            recorded[i] = episode_record(episode, source="evaluate", task=task, tokenizer=tokenizer, policies=policies)
        return row["data_source"], metrics

    recorded: dict[int, dict[str, Any]] = {}
    results = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    if records is not None:
        records.extend(recorded[i] for i in sorted(recorded))
    by_source: dict[str, list[float]] = defaultdict(list)
    sums: dict[str, list[float]] = defaultdict(list)
    for source, metrics in results:
        if "mas/success" not in metrics:
            raise ValueError(
                f"workflow {source!r} reports no 'mas/success' metric, so accuracy is undefined; set "
                "self.metrics['mas/success'] = 1.0 or 0.0 at the end of Workflow.run."
            )
        by_source[source].append(metrics["mas/success"])
        for key, value in metrics.items():
            if math.isfinite(value):
                sums[key].append(value)
    report = {f"success_rate/{source}": sum(v) / len(v) for source, v in sorted(by_source.items())}
    all_success = [s for v in by_source.values() for s in v]
    report["success_rate"] = sum(all_success) / len(all_success) if all_success else float("nan")
    report["aborted_rate"] = sum(m.get("mas/aborted", 0.0) for _, m in results) / len(results) if results else 0.0
    report["episodes"] = float(len(results))
    report.update({key: sum(v) / len(v) for key, v in sorted(sums.items())})
    return report


def _read_rows(path: str) -> list[dict[str, Any]]:
    import pandas as pd

    return pd.read_parquet(path).to_dict(orient="records")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m verl_mas.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, nargs="+", help="parquet split(s) from python -m verl_mas.data")
    parser.add_argument("--model", default=None, help="local transformers model directory serving every role not "
                        "given with --role")
    parser.add_argument("--role", action="append", default=[], metavar="ROLE=MODEL",
                        help="serve ROLE with the model in MODEL (repeatable), e.g. for a role swap; MODEL may be a "
                        "PEFT adapter directory (served merged onto its base)")
    parser.add_argument("--base", default=None, help="base model of adapter directories (default: the base named in "
                        "their adapter_config.json)")
    parser.add_argument("--branching", type=int, default=1, help="K candidates per node (1: single-sample accuracy)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--chat-template-kwargs", type=json.loads, default={}, metavar="JSON",
                        help='variables of the chat template, e.g. \'{"enable_thinking": false}\' (Qwen3 non-thinking)')
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N rows only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    parser.add_argument("--record", metavar="FILE", default=None,
                        help="also append every episode to FILE (JSON lines) for python -m verl_mas.view")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from verl_mas.routing import RoleRoutedClient, RoleRouter, roles_of_workflows

    role_models = parse_role_models(args.role)
    if args.model is None and not role_models:
        parser.error("give --model (every role) and/or --role ROLE=MODEL")
    paths = ([args.model] if args.model else []) + list(role_models.values())
    sources = {path: model_source(path, args.base) for path in dict.fromkeys(paths)}
    tokenizers = model_tokenizers([model for model, _ in sources.values()])
    tokenizers = {path: tokenizers[model] for path, (model, _) in sources.items()}
    rows = [row for path in args.data for row in _read_rows(path)][: args.limit]
    # The router training uses: here each model directory is a policy, --model the default one.
    router = RoleRouter(role_models, list(dict.fromkeys(paths)), default=args.model,
                        route="--role {role}=MODEL (or --model for every role not listed)")
    roles = roles_of_workflows(str(row["extra_info"]["workflow"]) for row in rows)
    problems = router.problems(roles)
    if problems:
        raise SystemExit("python -m verl_mas.evaluate: " + " ".join(problems))
    engines = {
        path: LocalModelClient(model, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                               adapter=adapter)
        for path, (model, adapter) in sources.items()
    }
    client = RoleRoutedClient.from_router(router, engines)
    tokenizer = router.tokenizers({path: tokenizers[path] for path in router.policies})
    config = EpisodeConfig(branching=args.branching, max_turns=args.max_turns, alpha=args.alpha,
                           chat_template_kwargs=dict(args.chat_template_kwargs))
    records: list[dict[str, Any]] | None = [] if args.record else None
    policies = {role: router.policy_of(role) for workflow_roles in roles.values() for role in workflow_roles}
    report = asyncio.run(evaluate(rows, client=client, tokenizer=tokenizer, config=config, seed=args.seed,
                                  records=records, policies=policies))
    for role, path in sorted(role_models.items()):
        print(f"{'role ' + role:<40} {path}")
    for key, value in report.items():
        print(f"{key:<40} {value:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if records is not None:
        from verl_mas.recording import write_records

        print(f"recorded {len(records)} episodes to {write_records(args.record, records)}")


if __name__ == "__main__":
    main()

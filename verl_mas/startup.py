"""Start-up of a verl_mas run: every problem of the config found in one pass, and what the ``mas`` trainer
changes in verl's config before verl reads it.

Called by :class:`verl_mas.trainer.MasTrainer` before verl builds anything (workers, pools, datasets), and,
in recipes that list the :class:`Preflight` Hydra callback, in verl's ``main_ppo`` process before Ray starts:
a bad recipe fails in seconds with one error listing every problem and its fix.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omegaconf import open_dict

from verl_mas.advantage.at_grpo import ESTIMATOR_NAME, SINGLETON_KEY
from verl_mas.backends.vllm.support import cpu_attention_problems, on_cpu
from verl_mas.config import MAS_TRAINER_MARK, POLICY_NAME, MasConfig, MasConfigError
from verl_mas.policies import policy_configs_and_problems, pool_memory_problems, shared_rollout_problems
from verl_mas.policies.adapters import ADAPTERS_KEY, adapter_plan, shared_base_plan
from verl_mas.registry import ENTRY_POINT_GROUP, get_workflow
from verl_mas.routing import RoleRouter, roles_of_workflows, workflows_in_data

__all__ = ["Preflight", "check_run_config", "drop_problems", "expand_per_role", "prepare_verl_config",
           "workflow_problems"]


def check_run_config(config: Any) -> tuple[MasConfig, dict[str, Any]]:
    """Every start-up problem of a verl_mas run, collected in one pass and raised once.

    Checks the ``mas:`` block, the algorithm and sampling settings it implies, every policy's overrides
    (unknown keys, keys one process reads for all policies, rollout backends that cannot serve several
    policies) and the routing of every role of every workflow in the data.

    Args:
        config: verl's full config (``algorithm``, ``actor_rollout_ref``, ``data``, ``mas``, ...).

    Returns:
        The ``mas:`` block and each policy's full ``actor_rollout_ref``.

    Raises:
        MasConfigError: listing every problem, each with its fix.
    """
    block = config.get("mas", None) if hasattr(config, "get") else None
    named = block.get("workflow", None) if block is not None and hasattr(block, "get") else None
    workflows = workflows_in_data(config) or ([named] if named else [])
    unresolved = workflow_problems(workflows)
    resolvable = [w for w in workflows if w not in unresolved]
    expansion_problems = expand_per_role(config, resolvable)
    mas, problems = MasConfig.parse(config.get("mas", None) if hasattr(config, "get") else None)
    problems = expansion_problems + problems
    algorithm = config.algorithm
    estimator = algorithm.adv_estimator
    if estimator != ESTIMATOR_NAME:
        problems.append(
            f"algorithm.adv_estimator is {estimator!r}, but trainer.v1.trainer_mode=mas builds AT-GRPO groups "
            f"for the {ESTIMATOR_NAME!r} estimator. Set algorithm.adv_estimator={ESTIMATOR_NAME}."
        )
    chosen = algorithm.get(SINGLETON_KEY, None)
    if chosen is not None and chosen != mas.singleton_advantage:
        problems.append(
            f"algorithm.{SINGLETON_KEY} is {chosen!r} but mas.singleton_advantage is {mas.singleton_advantage!r}; "
            f"the mas trainer sets algorithm.{SINGLETON_KEY} from mas.singleton_advantage. Set only the latter."
        )
    n = int(config.actor_rollout_ref.rollout.n)
    if mas.sampling == "tree" and n != 1:
        problems.append(
            f"actor_rollout_ref.rollout.n is {n}, but mas.sampling=tree samples K={mas.branching} candidates "
            "inside each episode; extra sessions would be independent episodes. Set rollout.n=1."
        )
    if mas.sampling == "parallel" and n < 2:
        problems.append(
            "mas.sampling=parallel draws K independent episodes per task through verl's rollout.n; set "
            "actor_rollout_ref.rollout.n=K (e.g. 4)."
        )
    if mas.grouping == "trajectory" and mas.sampling != "parallel":
        problems.append(
            "mas.grouping=trajectory normalises each role's episode score over the task's episodes, but "
            f"mas.sampling={mas.sampling} runs one episode per task, so every group would be a singleton "
            "(no signal). Use mas.sampling=parallel mas.branching=1 actor_rollout_ref.rollout.n=K."
        )
    configs: dict[str, Any] = {}
    if isinstance(mas.policies, Mapping) and mas.policies:
        configs, override_problems = policy_configs_and_problems(config.actor_rollout_ref, mas)
        problems.extend(override_problems)
        if configs:
            problems.extend(shared_rollout_problems(configs, mas))
            plan, plan_problems = shared_base_plan(mas, configs)
            problems.extend(plan_problems)
            if not on_cpu(config):  # vLLM's CPU build sizes its KV cache in bytes (verl_mas/conf/cpu_rollout/vllm.yaml)
                problems.extend(pool_memory_problems(configs, mas, one_engine=plan is not None))
            if plan is not None:  # the worker group and the rollout servers read it from the first policy's config
                primary = configs[mas.policy_names[0]]
                with open_dict(primary):
                    primary.rollout.custom = {**dict(primary.rollout.get("custom") or {}), ADAPTERS_KEY: plan}
    served = configs or {mas.policy_names[0]: config.actor_rollout_ref}  # every policy's actor_rollout_ref
    if mas.drop_zero_variance:
        problems.extend(drop_problems(config, served))
    problems.extend(cpu_attention_problems(config, configs or None))  # a model vLLM's CPU build cannot serve
    problems.extend(unresolved.values())
    if isinstance(mas.roles, Mapping):
        roles = roles_of_workflows(resolvable)
        if mas.multi_policy:
            problems.extend(RoleRouter.from_mas(mas).problems(roles))
        known = {r for of_workflow in roles.values() for r in of_workflow}
        strangers = sorted(set(mas.roles) - known)
        if roles and strangers:
            problems.append(
                f"mas.roles names roles {strangers} that no workflow of the data has (their roles: "
                f"{ {w: list(r) for w, r in sorted(roles.items())} }): check the spelling, or drop settings written for "
                "another workflow (mas.per_role gives every role of the data's workflows a policy by itself)."
            )
    if not problems:  # (with a broken block or routing the policies' models are not known)
        classes = {w: get_workflow(w) for w in resolvable}
        problems.extend(vocabulary_problems(classes, served, RoleRouter.from_mas(mas)))
    if problems:
        raise MasConfigError(
            f"verl_mas cannot start: {len(problems)} problem(s) in the config:\n  - " + "\n  - ".join(problems)
        )
    return mas, configs


def expand_per_role(config: Any, workflows: Sequence[str]) -> list[str]:
    """``mas.per_role``: one policy per role of ``workflows`` (the resolvable workflows the data names, or
    ``mas.workflow``), written into ``mas.policies`` and ``mas.roles`` of ``config`` (in place; ``per_role`` is
    removed). The problems it finds (none if the block has no ``per_role``).

    The roles come in the workflows' own role order, so the first role's policy runs in verl's own stack.
    Explicit ``mas.policies.<name>`` entries are merged over the expansion, explicit ``mas.roles.<role>`` entries
    kept.
    """
    from omegaconf import OmegaConf

    block = config.get("mas", None) if hasattr(config, "get") else None
    if block is None or block.get("per_role", None) is None:
        return []
    overrides = block.get("per_role")
    if not (isinstance(overrides, Mapping) or OmegaConf.is_dict(overrides)):
        return [f"mas.per_role is {overrides!r}; it must be a mapping of actor_rollout_ref overrides every role's "
                "policy gets ({} for the recipe's model as it is)."]
    roles: list[str] = []
    for roles_of in roles_of_workflows(workflows).values():
        roles.extend(r for r in roles_of if r not in roles)
    if not roles:
        return ["mas.per_role gives every role of the data's workflows a policy, but the data names no workflow "
                "this process can resolve (nor does mas.workflow): point data.train_files at data written by "
                "python -m verl_mas.data, or list mas.policies and mas.roles."]
    bad = [r for r in roles if not POLICY_NAME.fullmatch(r)]
    if bad:
        return [f"mas.per_role names each policy after its role, but roles {bad} are not policy names (a letter, "
                "then letters, digits or '-', at most 32). List mas.policies and mas.roles for these roles instead."]
    base = OmegaConf.to_container(OmegaConf.create(overrides), resolve=True)
    explicit = block.get("policies", None) or {}
    policies = {role: OmegaConf.merge(OmegaConf.create(base), explicit.get(role, None) or {}) for role in roles}
    for name, own in explicit.items():  # further policies the user listed (reported if they serve no role)
        if name not in policies:
            policies[name] = own
    routes = {role: {"policy": role} for role in roles}
    routes.update({role: settings for role, settings in (block.get("roles", None) or {}).items()})
    with open_dict(config):
        config.mas.policies = policies
        config.mas.roles = routes
        del config.mas["per_role"]
    return []


def workflow_problems(workflow_ids: Iterable[str]) -> dict[str, str]:
    """The workflow ids (of the data) this process cannot resolve, each with what, why and fix.

    verl's agent-loop workers resolve every row's ``extra_info.workflow`` in a Ray worker of their own, which
    imports nothing of the launching script: a workflow registered only in a module the workers never import is
    unknown there. Checked where the run starts (the driver, and verl's task runner, a Ray worker of the job).
    """
    out = {}
    for workflow_id in sorted(set(workflow_ids)):
        try:
            get_workflow(workflow_id)
        except (LookupError, ImportError, TypeError) as error:
            out[workflow_id] = (
                f"the data names workflow {workflow_id!r}, which this process cannot resolve ({error}). verl's "
                "agent-loop workers resolve it in Ray workers that import nothing of the launching script. Make it "
                f"importable there: publish it in the {ENTRY_POINT_GROUP!r} entry-point group of an installed package "
                "(pip install -e . in the environment Ray runs; docs/writing-a-workflow.md), or write the data with "
                "its 'package.module:Class' path (python -m verl_mas.data package.module:Class ...) from a package "
                "on the workers' PYTHONPATH."
            )
    return out


def vocabulary_problems(workflows: Mapping[str, Any], policy_configs: Mapping[str, Any], router: RoleRouter) -> list[str]:
    """Words of a workflow's declared ``vocabulary`` that the tokenizer of a policy serving one of its roles
    cannot write back: a role could never say them, or would read them mangled (``nothing`` as ``noting``).

    Checked for workflows that declare a ``vocabulary`` (a tailored tiny tokenizer, ``python -m verl_mas.tiny
    --vocab-from``), on each policy's own tokenizer (``model.tokenizer_path`` or ``model.path``); a model path
    that does not exist is left to verl, which reports it.
    """
    import os

    from verl_mas.testing.roundtrip import lost_words

    out: list[str] = []
    tokenizers: dict[str, Any] = {}
    for workflow_id, cls in sorted(workflows.items()):
        words = tuple(getattr(cls, "vocabulary", None) or ())
        if not words:
            continue
        for name in sorted({router.policy_of(role) for role in cls.roles} & set(policy_configs)):
            model = policy_configs[name].model
            path = model.get("tokenizer_path", None) or model.get("path", None)
            if not path or not os.path.isdir(str(path)):
                continue
            if path not in tokenizers:
                from transformers import AutoTokenizer

                tokenizers[path] = AutoTokenizer.from_pretrained(str(path))
            lost = [(w, back) for word in words for w, back in lost_words(tokenizers[path], word)]
            if lost:
                shown = ", ".join(f"{w!r} becomes {b!r}" for w, b in lost[:5])
                out.append(
                    f"policy {name!r}: its tokenizer ({path}) loses words of the vocabulary of workflow {workflow_id!r} "
                    f"({shown}{' ...' if len(lost) > 5 else ''}), so its roles could never say them or would read them "
                    f"mangled. Build the model's tokenizer from the workflow (python -m verl_mas.tiny --out DIR "
                    f"--vocab-from {workflow_id}), or point the policy's model.tokenizer_path at one that covers them."
                )
    return out


def drop_problems(config: Any, policy_configs: Mapping[str, Any]) -> list[str]:
    """Why ``mas.drop_zero_variance`` would change the loss of a run: one message per policy (and for the KL
    penalty in the reward).

    A dropped row's advantage is exactly 0, so it carries no policy-gradient term; but a KL loss
    (``actor.use_kl_loss``) and an entropy bonus (``actor.entropy_coeff``) have terms on every row, and a KL
    penalty in the reward (``algorithm.use_kl_in_reward``) gives flat groups non-zero advantages. Dropping rows
    would silently change those runs, so the combination is refused.
    """
    out = []
    if config.algorithm.get("use_kl_in_reward", False):
        out.append(
            "mas.drop_zero_variance leaves groups whose rewards are all equal out of the update, but "
            "algorithm.use_kl_in_reward=true subtracts a per-token KL penalty from those rewards, so their "
            "advantages are not 0 and dropping them would change the update. Set mas.drop_zero_variance=false, "
            "or algorithm.use_kl_in_reward=false."
        )
    for name, arr in policy_configs.items():
        actor = arr.actor
        terms = []
        if actor.get("use_kl_loss", False):
            terms.append("actor.use_kl_loss=true (a KL loss to the reference on every row)")
        coeff = float(actor.get("entropy_coeff", 0.0) or 0.0)
        if coeff != 0.0:
            terms.append(f"actor.entropy_coeff={coeff:g} (an entropy term on every row)")
        if terms:
            out.append(
                f"policy {name!r}: mas.drop_zero_variance leaves the rows of groups without signal out of the "
                f"update, but {' and '.join(terms)} gives those rows a gradient, so dropping them would change "
                "the loss. Set mas.drop_zero_variance=false, or turn the term off for this policy "
                "(actor.use_kl_loss=false, actor.entropy_coeff=0)."
            )
    return out


def prepare_verl_config(config: Any, mas: MasConfig, policy_configs: dict[str, Any]) -> None:
    """What the ``mas`` trainer changes in verl's config before verl's trainer reads it (in place).

    - ``trainer.v1.trainer_mode`` reads ``sync``: verl compares it with the literal "sync" in several places
      (replay buffer, batch sizes) and this mode is synchronous; ``trainer.v1.mas_trainer`` marks the config
      so that the ``mas`` agent loop knows it runs under this trainer;
    - ``algorithm.at_grpo_singleton`` carries ``mas.singleton_advantage`` to the ``at_grpo`` estimator;
    - ``actor_rollout_ref`` becomes the first policy's (the recipe's with its overrides; with a shared LoRA
      base, it carries every adapter in ``rollout.custom``, :mod:`verl_mas.policies.adapters`).
    """
    primary = mas.policy_names[0]
    with open_dict(config):
        config.trainer.v1.trainer_mode = "sync"
        config.trainer.v1[MAS_TRAINER_MARK] = True
        config.algorithm[SINGLETON_KEY] = mas.singleton_advantage
        if mas.policies[primary] or adapter_plan(policy_configs):
            config.actor_rollout_ref = policy_configs[primary]


def _hydra_callback_base() -> type:
    from hydra.experimental.callback import Callback

    return Callback


class Preflight(_hydra_callback_base()):  # type: ignore[misc]
    """Hydra callback: :func:`check_run_config` in the launching process, before verl starts Ray.

    The ``mas`` trainer checks the run where verl builds it, in its task runner, after Ray and verl have
    started (a minute or more on a small machine). Everything that needs only the config and the data files
    (the ``mas:`` block, every policy's overrides, routing, the data's workflow ids) is known before that:
    a recipe that lists this callback in its ``hydra.callbacks`` gets the same one error in seconds::

        hydra:
          callbacks:
            verl_mas_preflight:
              _target_: verl_mas.startup.Preflight

    Hydra runs ``on_job_start`` in verl's ``main_ppo`` process just before verl's ``main``. Hydra turns an
    exception of a callback into a warning and goes on, so the problems end the process with ``SystemExit``
    (exit status 1, the message on stderr), which it lets through. Runs whose trainer mode is not ``mas`` are
    left alone. The checks run again in the trainer (a config composed without this callback is still
    checked).
    """

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        import copy

        v1 = (config.get("trainer", None) or {}).get("v1", None) or {}
        if v1.get("trainer_mode", None) != "mas":
            return
        try:
            check_run_config(copy.deepcopy(config))
        except MasConfigError as error:
            raise SystemExit(f"{error}\n(checked before Ray started, by verl_mas.startup.Preflight)") from None


# verl may have been imported for the first time from inside this module, before it was whole, so that
# verl_mas's plugin had to defer its registration: finish it now (see verl_mas._plugin, "Import order").
if (_plugin := sys.modules.get("verl_mas._plugin")) is not None:
    _plugin.complete(__name__)

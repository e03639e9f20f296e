"""PPO mini-batch arithmetic for batches of varying row count: the padding multiple and the update's mini-batch size.

verl sizes an actor update's mini-batches as ``actor.ppo_mini_batch_size * rollout.n`` rows, which assumes
one row per session. An AT-GRPO episode yields a variable number of rows (roles x turns x K candidates),
so the mas trainer pads each batch with :func:`batch_multiple_for` (in ``_get_required_batch_multiple``)
and sets ``actor.ppo_mini_batch_size`` to :func:`ppo_mini_batch_size_for` around verl's ``_update_actor``.
The padding also serves verl's log-prob passes, which split each rank's rows into micro-batches of
``log_prob_micro_batch_size_per_gpu`` without dynamic batch size.

What verl 0.9.1 requires of a global mini-batch of ``M`` rows over a padded batch of ``B`` rows (``d``
data-parallel ranks, ``n = rollout.n``):

- ``M % n == 0``: verl multiplies ``ppo_mini_batch_size`` by ``n`` (``PPOTrainer._update_actor``), so only
  multiples of ``n`` can be asked for;
- ``M % d == 0``: ``TrainingWorker.train_mini_batch`` asserts ``mini_batch_size % dp == 0`` and gives each
  rank ``m = M // d`` rows per mini-batch;
- ``(B // d) % m == 0``: ``tensordict_utils.make_iterator`` asserts that each rank's ``B // d`` rows (the
  dispatch's contiguous ``BatchMeta.chunk`` after ``_balance_batch``) split into whole mini-batches; no row
  is dropped or repeated within an epoch;
- without dynamic batch size, ``m % micro_batch_size_per_gpu == 0`` (``engine.utils.prepare_micro_batches``)
  and, with Megatron's virtual pipeline, the micro-batch count ``m // micro`` a multiple of
  ``microbatch_group_size_per_vp_stage`` (``MegatronEngine.forward_backward_batch``); with dynamic batch
  size and a virtual pipeline, ``m`` at least that group size (``rearrange_micro_batches``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "actor_dp_size",
    "ROWS_BEFORE_DROP_TAG",
    "batch_multiple_for",
    "dropped_rows_steps",
    "log_prob_micro_batch_sizes",
    "mini_batch_settings",
    "optimizer_steps_for",
    "ppo_mini_batch_size_for",
]


def optimizer_steps_for(train_batch_size: int, ppo_mini_batch_size: int) -> int:
    """Optimiser steps per epoch of one training step in stock verl: ``ceil(train_batch_size / ppo_mini_batch_size)``.

    verl pads the ``train_batch_size * n`` rows of a step to a multiple of ``ppo_mini_batch_size * n``
    (``PPOTrainer._get_required_batch_multiple``), so a remainder becomes one more, padded, mini-batch:
    ``train_batch_size // ppo_mini_batch_size`` when the one divides the other, one more otherwise.
    """
    return -(-train_batch_size // ppo_mini_batch_size)


def _unit(rollout_n: int, dp_size: int, micro_batch_size_per_gpu: int | None, micro_batches_divisible_by: int) -> int:
    """The smallest global mini-batch (rows) verl accepts; every accepted one is a multiple of it."""
    per_gpu = 1 if micro_batch_size_per_gpu is None else micro_batch_size_per_gpu * micro_batches_divisible_by
    return math.lcm(rollout_n, dp_size * per_gpu)


def _check(
    settings: dict[str, Any],
    rows: int | None = None,
    log_prob_micro: tuple[int, ...] = (),
    padding_rows: int | None = None,
) -> None:
    problems = []
    for name in ("train_batch_size", "ppo_mini_batch_size", "rollout_n", "dp_size", "micro_batches_divisible_by"):
        value = settings[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} is {value!r}; it must be a positive integer")
    micro = settings["micro_batch_size_per_gpu"]
    if micro is not None and (isinstance(micro, bool) or not isinstance(micro, int) or micro < 1):
        problems.append(
            f"micro_batch_size_per_gpu is {micro!r}; set actor.ppo_micro_batch_size_per_gpu to a positive integer, "
            "or None with actor.use_dynamic_bsz=true"
        )
    if any(isinstance(lp, bool) or not isinstance(lp, int) or lp < 1 for lp in log_prob_micro):
        problems.append(f"log_prob_micro_batch_sizes_per_gpu is {log_prob_micro!r}; each must be a positive integer")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        problems.append(f"rows is {rows!r}; an update needs at least one row")
    if padding_rows is not None and (
        isinstance(padding_rows, bool) or not isinstance(padding_rows, int) or padding_rows < 0
        or (isinstance(rows, int) and padding_rows >= rows)
    ):
        problems.append(
            f"padding_rows is {padding_rows!r} of {rows!r} rows; it counts verl's is_padding rows, fewer than all "
            "(verl pads from a real row)"
        )
    if problems:
        raise ValueError("Invalid PPO mini-batch settings:\n  - " + "\n  - ".join(problems))


def _steps_and_unit(
    train_batch_size: int,
    ppo_mini_batch_size: int,
    rollout_n: int,
    dp_size: int,
    micro_batch_size_per_gpu: int | None,
    micro_batches_divisible_by: int,
    **checked: Any,
) -> tuple[int, int]:
    """Check the settings (and ``checked``: rows, padding, log-prob micro sizes); stock verl's step count ``S`` and
    the smallest accepted mini-batch ``G``."""
    _check(dict(train_batch_size=train_batch_size, ppo_mini_batch_size=ppo_mini_batch_size, rollout_n=rollout_n,
                dp_size=dp_size, micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                micro_batches_divisible_by=micro_batches_divisible_by), **checked)
    return (optimizer_steps_for(train_batch_size, ppo_mini_batch_size),
            _unit(rollout_n, dp_size, micro_batch_size_per_gpu, micro_batches_divisible_by))


def batch_multiple_for(
    *,
    train_batch_size: int,
    ppo_mini_batch_size: int,
    rollout_n: int,
    dp_size: int,
    micro_batch_size_per_gpu: int | None,
    micro_batches_divisible_by: int = 1,
    log_prob_micro_batch_sizes_per_gpu: tuple[int, ...] = (),
) -> int:
    """The multiple to pad a policy's batch to so that its update can take stock verl's number of steps.

    ``lcm(S * G, dp_size * lp for lp in log_prob_micro_batch_sizes_per_gpu)`` with
    ``S = ceil(train_batch_size / ppo_mini_batch_size)`` (:func:`optimizer_steps_for`) and
    ``G = lcm(rollout_n, dp_size * micro_batch_size_per_gpu * micro_batches_divisible_by)`` (``micro = 1``
    with dynamic batch size), the smallest mini-batch verl accepts. A batch padded to a multiple of ``S * G``
    splits into ``S`` mini-batches of ``rows / S`` rows, each a multiple of ``G`` (:func:`ppo_mini_batch_size_for`
    takes fewer only when ``S`` of them could be padding only); the log-prob term lets every
    rank's rows split into whole log-prob micro-batches (``prepare_micro_batches`` asserts it in
    ``compute_log_prob`` / ``compute_ref_log_prob``), which stock verl gets from ``train_batch_size * n``.
    Return it from ``_get_required_batch_multiple(dp_size)``: verl's ``_balance_batch`` then appends the
    no-op ``is_padding`` rows (``upsample_batch_to_divisible_size``); a multiple of ``dp_size``, as balancing
    needs.

    Example: 64/16, 8 GPUs, micro 1, 100 rows: ``S = 4``, ``G = 8``, multiple 32, so 128 rows (28 padding
    rows of 128 tokens each, where verl's own multiple of 16 gives 112) and 4 mini-batches of 32. With
    ``log_prob_micro_batch_size_per_gpu=32`` the multiple is ``lcm(32, 8 * 32) = 256``: dynamic batch size
    (``*use_dynamic_bsz``) avoids that padding.

    Args:
        train_batch_size: ``data.train_batch_size`` (tasks per step).
        ppo_mini_batch_size: the configured ``actor.ppo_mini_batch_size`` (tasks per mini-batch).
        rollout_n: ``actor_rollout_ref.rollout.n``.
        dp_size: the actor's data-parallel size, as ``_balance_batch`` reads it from the worker group.
        micro_batch_size_per_gpu: ``actor.ppo_micro_batch_size_per_gpu``; ``None`` with ``actor.use_dynamic_bsz``.
        micro_batches_divisible_by: Megatron with a virtual pipeline: ``microbatch_group_size_per_vp_stage``; else 1.
        log_prob_micro_batch_sizes_per_gpu: the static micro-batch sizes of the log-prob passes run on the
            batch (:func:`log_prob_micro_batch_sizes`).

    Raises:
        ValueError: a setting is not a positive integer.
    """
    steps, unit = _steps_and_unit(train_batch_size, ppo_mini_batch_size, rollout_n, dp_size, micro_batch_size_per_gpu,
                                  micro_batches_divisible_by, log_prob_micro=log_prob_micro_batch_sizes_per_gpu)
    if micro_batch_size_per_gpu is None and micro_batches_divisible_by > 1:
        # dynamic batch size with a virtual pipeline needs >= micro_batches_divisible_by rows per rank
        unit = math.lcm(unit, dp_size * micro_batches_divisible_by)
    return math.lcm(steps * unit, *(dp_size * lp for lp in log_prob_micro_batch_sizes_per_gpu))


def ppo_mini_batch_size_for(
    rows: int,
    *,
    padding_rows: int,
    train_batch_size: int,
    ppo_mini_batch_size: int,
    rollout_n: int,
    dp_size: int,
    micro_batch_size_per_gpu: int | None,
    micro_batches_divisible_by: int = 1,
    target_steps: int | None = None,
) -> int:
    """The ``actor.ppo_mini_batch_size`` to set for one update of ``rows`` (padded) rows.

    Rule: the global mini-batch ``M = result * rollout_n`` is a multiple of
    ``G = lcm(rollout_n, dp_size * micro)`` (``micro = micro_batch_size_per_gpu * micro_batches_divisible_by``;
    1 with dynamic batch size) that divides ``rows``, so every rank splits its ``rows / dp_size`` rows into
    whole mini-batches and every row is trained on exactly once per epoch; and ``M > padding_rows``, so no
    mini-batch can be padding only (its token-mean loss would be 0/0: verl skips the non-finite step and logs
    NaN; stock verl's padding is always smaller than its mini-batch). Among those, the one whose step count
    ``rows / M`` is nearest stock verl's ``S = ceil(train_batch_size / ppo_mini_batch_size)``; on a tie, the
    fewer steps. When ``rows`` is a multiple of :func:`batch_multiple_for` (the trainer pads to it), that is
    exactly ``S`` steps of ``rows / S`` rows unless the padding reaches ``rows / S`` rows, which takes a
    policy with fewer rows than about ``S`` times the multiple.

    Worked example: ``train_batch_size=64``, ``ppo_mini_batch_size=16``, 8 GPUs, micro 1, ``n=1``, 100 rows.
    ``S = 4``, ``G = 8``.

    - Padded by :func:`batch_multiple_for` (multiple 32): 128 rows (28 padding), ``M = 32 > 28``, result 32:
      4 steps of 4 rows per GPU, as stock verl.
    - Padded by verl's own multiple ``lcm(8, 16) = 16``: 112 rows (12 padding), 14 per GPU. The old formula
      chose ``M = 24`` (3 per GPU) and verl asserted ``14 % 3 != 0``. The multiples of 8 dividing 112 are 8,
      16, 56 and 112, i.e. 14, 7, 2 or 1 steps, all above 12 rows; 2 is nearest 4 (7 is 3 away), so result 56:
      2 steps of 7 per GPU.
    - 33 rows padded to 64 (31 padding): 4 steps of 16 could leave one all padding; 2 steps of 32.

    Args:
        rows: rows of the batch handed to ``_update_actor`` (after ``_balance_batch``'s padding).
        padding_rows: how many of them verl added as padding (tags with ``is_padding``).
        train_batch_size: ``data.train_batch_size`` (tasks per step).
        ppo_mini_batch_size: the configured ``actor.ppo_mini_batch_size`` (tasks per mini-batch).
        rollout_n: ``actor_rollout_ref.rollout.n``.
        dp_size: the actor's data-parallel size (:func:`actor_dp_size`).
        micro_batch_size_per_gpu: ``actor.ppo_micro_batch_size_per_gpu``; ``None`` with ``actor.use_dynamic_bsz``.
        micro_batches_divisible_by: Megatron with a virtual pipeline: ``microbatch_group_size_per_vp_stage``; else 1.
        target_steps: The step count to come nearest instead of ``S`` (:func:`dropped_rows_steps`: a batch that
            lost rows to ``mas.drop_zero_variance`` takes fewer steps of the same size).

    Returns:
        The value for ``actor.ppo_mini_batch_size`` (>= 1); verl trains ``rows // (result * rollout_n)``
        mini-batches per epoch.

    Raises:
        ValueError: no mini-batch size exists that verl accepts for ``rows`` (it is not a multiple of
            ``dp_size`` or of ``G``, or every row is padding), or a setting is not a positive integer.
    """
    target, unit = _steps_and_unit(train_batch_size, ppo_mini_batch_size, rollout_n, dp_size, micro_batch_size_per_gpu,
                                   micro_batches_divisible_by, rows=rows, padding_rows=padding_rows)
    fix = (
        "Pad the batch with verl_mas.minibatch.batch_multiple_for(...) from the trainer's "
        "_get_required_batch_multiple (verl's _balance_batch pads to it)."
    )
    if rows % dp_size:
        raise ValueError(
            f"{rows} rows do not split over {dp_size} data-parallel ranks. verl's _balance_batch pads every batch "
            f"to a multiple of the data-parallel size before the update; pass the padded row count. {fix}"
        )
    if rows % unit:
        raise ValueError(
            f"{rows} rows have no PPO mini-batch split that verl accepts: a mini-batch must be a multiple of "
            f"{unit} rows (lcm of rollout.n={rollout_n} and data-parallel size {dp_size} x micro-batch "
            f"{micro_batch_size_per_gpu or 1} x {micro_batches_divisible_by}) and divide the batch. {fix}"
        )
    # the step counts on offer are the divisors of rows // unit
    most = rows // unit
    if micro_batch_size_per_gpu is None and micro_batches_divisible_by > 1:
        most = min(most, rows // (dp_size * micro_batches_divisible_by))
    if most < 1:
        raise ValueError(
            f"{rows} rows give fewer than {micro_batches_divisible_by} rows per data-parallel rank; with dynamic "
            "batch size and a virtual pipeline verl needs that many per mini-batch. " + fix
        )
    offered = [s for s in range(1, most + 1) if (rows // unit) % s == 0 and rows // s > padding_rows]
    if target_steps is not None:
        target = target_steps
    steps = min(offered, key=lambda s: (abs(s - target), s))
    return rows // steps // rollout_n


def mini_batch_settings(config: Any, *, dp_size: int) -> dict[str, Any]:
    """The keyword arguments of :func:`ppo_mini_batch_size_for` and :func:`batch_multiple_for` from a verl config.

    Args:
        config: the trainer config (``data``, ``actor_rollout_ref``); reads the *configured*
            ``actor.ppo_mini_batch_size``, so call it outside the update's temporary override.
        dp_size: the actor's data-parallel size (``max(worker_group._dispatch_info["actor"]) + 1``).
    """
    actor = config.actor_rollout_ref.actor
    micro = None if actor.get("use_dynamic_bsz", False) else actor.get("ppo_micro_batch_size_per_gpu")
    if micro is None and not actor.get("use_dynamic_bsz", False):
        raise ValueError(
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is not set and use_dynamic_bsz is false; verl's "
            "engine workers need one of them (the global ppo_micro_batch_size is not read). Set "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or actor_rollout_ref.actor.use_dynamic_bsz=true."
        )
    vpp = 1
    megatron = actor.get("megatron") if actor.get("strategy") == "megatron" else None
    if megatron is not None and (megatron.get("virtual_pipeline_model_parallel_size") or 1) > 1:
        # set through override_transformer_config; megatron-core's default is the pipeline size
        override = megatron.get("override_transformer_config") or {}
        vpp = int(
            override.get("microbatch_group_size_per_vp_stage") or megatron.get("pipeline_model_parallel_size") or 1
        )
    return dict(
        train_batch_size=int(config.data.train_batch_size),
        ppo_mini_batch_size=int(actor.ppo_mini_batch_size),
        rollout_n=int(config.actor_rollout_ref.rollout.n),
        dp_size=int(dp_size),
        micro_batch_size_per_gpu=None if micro is None else int(micro),
        micro_batches_divisible_by=vpp,
    )


def log_prob_micro_batch_sizes(config: Any, *, use_reference_policy: bool) -> tuple[int, ...]:
    """The static micro-batch sizes (per GPU) of the log-prob passes verl runs on a training batch.

    ``rollout.log_prob_micro_batch_size_per_gpu`` for the old log-probs and, with a reference policy,
    ``ref.log_prob_micro_batch_size_per_gpu``; a pass with ``log_prob_use_dynamic_bsz`` adds nothing.
    """
    arr = config.actor_rollout_ref
    sizes = []
    sections = [arr.rollout] + ([arr.ref] if use_reference_policy and "ref" in arr else [])
    for section in sections:
        micro = section.get("log_prob_micro_batch_size_per_gpu")
        if not section.get("log_prob_use_dynamic_bsz", False) and micro is not None:
            sizes.append(int(micro))
    return tuple(sizes)


def actor_dp_size(worker_group: Any) -> int:
    """The actor's data-parallel size, read from ``worker_group`` as verl's ``_balance_batch`` reads it.

    Not ``n_gpus_per_node * nnodes``: sequence/tensor parallelism shrink it, and a policy on a resource pool of
    its own has fewer GPUs.
    """
    if "actor" not in worker_group._dispatch_info:
        worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
    return max(worker_group._dispatch_info["actor"]) + 1


def required_batch_multiple(config: Any, *, dp_size: int, use_reference_policy: bool) -> int:
    """What the mas trainer's ``_get_required_batch_multiple`` returns: verl's ``_balance_batch`` pads to it.

    (verl's own multiple adds the critic's mini-batch; AT-GRPO runs without a critic.)
    """
    return batch_multiple_for(
        **mini_batch_settings(config, dp_size=dp_size),
        log_prob_micro_batch_sizes_per_gpu=log_prob_micro_batch_sizes(config, use_reference_policy=use_reference_policy),
    )


#: Tag the mas trainer gives the rows it keeps when ``mas.drop_zero_variance`` drops others: the policy's row
#: count before the drop (:func:`dropped_rows_steps`).
ROWS_BEFORE_DROP_TAG = "mas_rows_before_drop"


def dropped_rows_steps(steps: int, kept_rows: int, rows_before_drop: int) -> int:
    """Optimiser steps for a batch that kept ``kept_rows`` of ``rows_before_drop`` rows: ``ceil(steps * kept /
    before)``, at least 1.

    Dropping rows removes optimiser steps, not rows per step: each mini-batch holds as many rows as stock
    verl's would have held for the whole batch. Keeping ``steps`` steps instead would split a handful of rows
    (at convergence, when nearly every group is flat) into ``steps`` tiny mini-batches, each an Adam step of
    full size on a few samples: measured, that undoes a learnt relay team within 10 steps.
    """
    if kept_rows < 1 or rows_before_drop < kept_rows:
        raise ValueError(f"kept {kept_rows} of {rows_before_drop} rows: kept must be in 1..before")
    return max(1, -(-steps * kept_rows // rows_before_drop))


def update_mini_batch_size(config: Any, batch: Any, *, dp_size: int) -> int:
    """The ``actor.ppo_mini_batch_size`` the mas trainer sets around verl's ``_update_actor`` for ``batch``.

    Rows the trainer kept out of a larger batch (``mas.drop_zero_variance``: tagged with
    :data:`ROWS_BEFORE_DROP_TAG`) take :func:`dropped_rows_steps` steps instead of stock verl's ``S``.

    Args:
        config: The (policy's) trainer config, with the configured ``actor.ppo_mini_batch_size``.
        batch: The padded, balanced batch (a ``KVBatchMeta``: ``keys`` and ``tags`` with ``is_padding``).
        dp_size: The actor's data-parallel size (:func:`actor_dp_size`).
    """
    padding = sum(bool(tag.get("is_padding", False)) for tag in batch.tags)
    settings = mini_batch_settings(config, dp_size=dp_size)
    before = {tag[ROWS_BEFORE_DROP_TAG] for tag in batch.tags
              if not tag.get("is_padding", False) and ROWS_BEFORE_DROP_TAG in tag}
    target = None
    if before:
        steps = optimizer_steps_for(settings["train_batch_size"], settings["ppo_mini_batch_size"])
        target = dropped_rows_steps(steps, len(batch.keys) - padding, max(before))
    return ppo_mini_batch_size_for(len(batch.keys), padding_rows=padding, target_steps=target, **settings)

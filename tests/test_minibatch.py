"""verl_mas.minibatch against verl 0.9.1's own padding, data-parallel split, mini-batch iterator and micro-batching.

Each combination runs one policy update's batch through verl's code, not a copy of its arithmetic:

1. ``PPOTrainer._balance_batch`` (unbound, on a stub trainer): ``_get_required_batch_multiple`` (verl's, or
   the mas override built from :func:`batch_multiple_for`), ``upsample_batch_to_divisible_size`` over a
   dict-backed TransferQueue, the Karmarkar-Karp reorder (in the big grid on a quarter of the row counts and
   all the small ones: it is most of the run time and moves rows between ranks, never changes how many);
2. ``PPOTrainer._update_actor`` (unbound): the mini-batch size and epochs it hands the workers;
3. ``_split_args_kwargs_data_proto``, the split of ``make_nd_compute_dataproto_dispatch_fn``, into dp chunks
   (``BatchMeta.chunk``; the KVBatchMeta -> BatchMeta translation before it is a TransferQueue controller call);
4. per rank ``TrainingWorker.train_mini_batch`` (its ``mini_batch_size % dp`` assert, ``make_iterator`` and
   its divisibility assert, the lr-scheduler flag) and ``TrainingWorker.train_batch`` (the micro-batch
   settings it injects) on a stub engine whose ``train_batch`` calls verl's ``prepare_micro_batches``
   (static: its divisibility assert; dynamic: ``rearrange_micro_batches``). Memoised per (rows per rank,
   settings): without shuffling its outcome depends on nothing else.

The stubs stand in for what needs Ray, GPUs or a model: the worker group (one Python call per rank instead of
a Ray actor), TransferQueue (a dict) and the engine's forward/backward. ``MegatronEngine`` is not importable
without megatron-core, so its one extra assertion (micro-batch count a multiple of
``microbatch_group_size_per_vp_stage``) is restated in the stub engine and marked as such.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from transfer_queue import BatchMeta, KVBatchMeta
from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
from verl.trainer.ppo import padding_utils
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
from verl.workers.engine.utils import prepare_micro_batches
from verl.workers.engine_workers import TrainingWorker

from verl_mas.minibatch import (
    actor_dp_size,
    batch_multiple_for,
    log_prob_micro_batch_sizes,
    mini_batch_settings,
    optimizer_steps_for,
    ppo_mini_batch_size_for,
    required_batch_multiple,
    update_mini_batch_size,
)

PAIRS = [(64, 16), (96, 32), (120, 40), (128, 64), (8, 2), (4, 4), (16, 3), (32, 8)]
DP_SIZES = [1, 2, 4, 8]


# ---- the harness: verl's code with stubs for Ray, TransferQueue and the model ------------------------------
@pytest.fixture(autouse=True)
def _no_transfer_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A path that reaches the real TransferQueue would start Ray and wait for a controller: fail instead."""
    import transfer_queue

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("this test reached the real TransferQueue; stub the call")

    monkeypatch.setattr(transfer_queue, "init", refuse)


class DictTransferQueue:
    """The two TransferQueue calls ``upsample_batch_to_divisible_size`` makes, over a dict."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str] | None = None) -> TensorDict:
        return tu.list_of_dict_to_tensordict([self.rows[k] for k in keys])

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: TensorDict, tags: list | None = None) -> None:
        self.rows.update(dict.fromkeys(keys, {}))  # the padding rows; nothing downstream here reads their fields


class StubEngine:
    """One data-parallel rank's engine: verl's micro-batching, no model."""

    def __init__(self, rank: int, dp_size: int, vpp: int, record: list) -> None:
        self.rank, self.dp_size, self.vpp, self.record = rank, dp_size, vpp, record
        self.lr_steps = 0

    def get_data_parallel_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_group(self) -> None:
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return False

    def train_mode(self, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def lr_scheduler_step(self) -> float:
        self.lr_steps += 1
        return 0.0

    def eval_mode(self, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def infer_batch(self, data: TensorDict, loss_function: Any = None) -> dict:
        # FSDPEngine.infer_batch -> forward_backward_batch: the whole rank's rows into log-prob micro-batches
        prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=True)
        return {"model_output": {}, "metrics": {}}

    def train_batch(self, data: TensorDict, loss_function: Any) -> dict:
        if tu.get(data, "use_dynamic_bsz"):
            # rearrange_micro_batches balances by token count: give it the rows' lengths
            lengths = data["seq_len"].tolist()
            data = data.clone()
            data["input_ids"] = torch.nested.as_nested_tensor(
                [torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged
            )
        micro_batches, _ = prepare_micro_batches(
            data, dp_group=None, num_batches_divided_by=self.vpp if self.vpp > 1 else None, same_micro_num_in_dp=True
        )
        if self.vpp > 1:  # restated from MegatronEngine.forward_backward_batch (megatron-core is not installed)
            assert len(micro_batches) % self.vpp == 0, f"{len(micro_batches)} micro-batches, vpp group {self.vpp}"
        self.record.append(data["row"].tolist())
        return {"model_output": {}, "metrics": {}}


def _rank_worker(
    rank: int, dp_size: int, micro: int | None, vpp: int, record: list, log_prob_micro: int | None = None
) -> SimpleNamespace:
    """What ``TrainingWorker.train_mini_batch`` / ``train_batch`` read from ``self``."""
    worker = SimpleNamespace(
        engine=StubEngine(rank, dp_size, vpp, record),
        profiler=SimpleNamespace(  # a disabled DistProfiler
            rank=rank, step=lambda: None, check_enable=lambda: False, check_this_step=lambda: False,
            check_this_rank=lambda: False,
        ),
        loss_fn=lambda *a, **k: None,
        engine_config=SimpleNamespace(
            forward_only=False,
            use_dynamic_bsz=micro is None,
            max_token_len_per_gpu=4096,
            micro_batch_size_per_gpu=micro,
            infer_max_token_len_per_gpu=4096,
            infer_micro_batch_size_per_gpu=log_prob_micro,
            use_fused_kernels=False,
        ),
        model_config={"use_remove_padding": True},
    )
    worker.train_batch = functools.partial(TrainingWorker.train_batch, worker)
    return worker


@dataclass
class Update:
    padded_rows: int
    ppo_mini_batch_size: int
    steps_per_rank: list[int]  # mini-batches each rank trained on, all epochs
    lr_steps_per_rank: list[int]
    mini_batches: list[list[str]] = field(default_factory=list)  # global mini-batch -> keys, all epochs


class StubWorkerGroup:
    """verl's dispatch of ``update_actor``: the dp split of the KVBatchMeta, then each rank's worker code."""

    def __init__(self, dp_size: int, micro: int | None, vpp: int) -> None:
        self.dp_size, self.micro, self.vpp = dp_size, micro, vpp
        self._dispatch_info = {"actor": list(range(dp_size))}  # one GPU per dp rank (no TP/SP)
        self.records: list[list[list[int]]] = []  # rank -> mini-batch -> rows
        self.lr_steps: list[int] = []

    def update_actor(self, batch: KVBatchMeta) -> dict:
        # verl's BatchData.chunk first translates a KVBatchMeta into TransferQueue's BatchMeta (a controller
        # call, here: the row positions as global indexes), then splits it with BatchMeta.chunk
        meta = BatchMeta(
            global_indexes=list(range(len(batch))), partition_ids=[batch.partition_id] * len(batch),
            extra_info=batch.extra_info,
        )
        (chunks,), _ = _split_args_kwargs_data_proto(self.dp_size, meta)
        self.records, self.lr_steps = [], []
        for rank, chunk in enumerate(chunks):
            rows = list(chunk.global_indexes)
            seq_lens = tuple(batch.tags[i]["seq_len"] for i in rows)
            positions, lr_steps = self._train_mini_batch(rank, seq_lens, dict(chunk.extra_info))
            self.records.append([[rows[p] for p in mb] for mb in positions])
            self.lr_steps.append(lr_steps)
        return {"metrics": {"mfu": [0.0]}}

    def _train_mini_batch(self, rank: int, seq_lens: tuple[int, ...], extra_info: dict) -> tuple[list, int]:
        """``TrainingWorker.train_mini_batch`` on one rank's rows; returns the row positions of each mini-batch.

        Memoised: with static micro-batches and no shuffling the outcome depends only on the row count and the
        settings (the same for every rank and for repeated shapes), which keeps the grid fast.
        """
        shuffle = extra_info.get("dataloader_kwargs", {}).get("shuffle", False)
        key = (
            len(seq_lens), repr(sorted(extra_info.items())), self.dp_size, self.micro, self.vpp,
            seq_lens if self.micro is None else None, rank if shuffle else None,
        )
        if key not in _WORKER_MEMO:
            record: list = []
            worker = _rank_worker(rank, self.dp_size, self.micro, self.vpp, record)
            data = TensorDict(
                {"row": torch.arange(len(seq_lens)), "seq_len": torch.tensor(seq_lens, dtype=torch.long)},
                batch_size=len(seq_lens),
            )
            for name, val in extra_info.items():  # as verl's tqbridge hands extra_info to the worker
                tu.assign_non_tensor_data(tensor_dict=data, key=name, val=val)
            try:
                TrainingWorker.train_mini_batch(worker, data)
                _WORKER_MEMO[key] = (record, worker.engine.lr_steps)
            except (AssertionError, ValueError) as err:
                _WORKER_MEMO[key] = err
        outcome = _WORKER_MEMO[key]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


_WORKER_MEMO: dict[tuple, Any] = {}


def _config(
    train_batch_size: int, mini: int, n: int, micro: int | None, vpp: int, epochs: int, shuffle: bool,
    log_prob_micro: int | None = None,
) -> Any:
    megatron = {}
    if vpp > 1:
        megatron = {
            "virtual_pipeline_model_parallel_size": 2,
            "pipeline_model_parallel_size": vpp,
            "override_transformer_config": {},
        }
    return OmegaConf.create(
        {
            "data": {"train_batch_size": train_batch_size},
            "trainer": {"critic_warmup": 0},
            "actor_rollout_ref": {
                "actor": {
                    "strategy": "megatron" if vpp > 1 else "fsdp",
                    "megatron": megatron,
                    "ppo_mini_batch_size": mini,
                    "ppo_micro_batch_size_per_gpu": micro,
                    "use_dynamic_bsz": micro is None,
                    "ppo_epochs": epochs,
                    "shuffle": shuffle,
                    "data_loader_seed": 42,
                    "calculate_entropy": False,
                    "entropy_coeff": 0.0,
                },
                "rollout": {
                    "n": n,
                    "temperature": 1.0,
                    "log_prob_micro_batch_size_per_gpu": log_prob_micro,
                    "log_prob_use_dynamic_bsz": log_prob_micro is None,
                },
            },
        }
    )


def pad_and_balance(
    rows: int,
    train_batch_size: int,
    mini: int,
    dp_size: int,
    *,
    n: int = 1,
    micro: int | None = 1,
    vpp: int = 1,
    padding: str = "mas",
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    balance: bool = True,
    log_prob_micro: int | None = None,
    tag: dict | None = None,
) -> tuple[SimpleNamespace, KVBatchMeta]:
    """``rows`` rows through verl's ``_balance_batch``, with verl's multiple, the mas one, or none (``dp``).

    ``balance=False`` runs only its padding step (``upsample_batch_to_divisible_size`` to
    ``_get_required_batch_multiple``), not the Karmarkar-Karp reorder, which is most of the grid's run time and
    changes which rows a rank gets, not how many.
    """
    tq = DictTransferQueue()
    rng = random.Random(seed)
    keys = [f"task{i}_0_0" for i in range(rows)]
    for key in keys:
        tq.rows[key] = {"input_ids": torch.zeros(4, dtype=torch.long), "uid": key.split("_")[0]}
    batch = KVBatchMeta(
        keys=keys, tags=[{"seq_len": rng.randint(16, 256), **(tag or {})} for _ in keys], partition_id="train",
        extra_info={}
    )
    trainer = SimpleNamespace(
        config=_config(train_batch_size, mini, n, micro, vpp, epochs, shuffle, log_prob_micro),
        use_critic=False,
        global_steps=1,
        tokenizer=SimpleNamespace(eos_token_id=0),
        actor_rollout_wg=StubWorkerGroup(dp_size, micro, vpp),
    )
    if padding == "verl":
        trainer._get_required_batch_multiple = functools.partial(PPOTrainer._get_required_batch_multiple, trainer)
    elif padding == "none":  # rows already padded: the dp multiple leaves them as they are
        trainer._get_required_batch_multiple = lambda dp: dp
    else:  # the mas trainer's override
        trainer._get_required_batch_multiple = lambda dp: required_batch_multiple(
            trainer.config, dp_size=dp, use_reference_policy=False)
    saved, padding_utils.tq = padding_utils.tq, tq
    try:
        if balance:
            batch = PPOTrainer._balance_batch(trainer, batch, metrics={})
        else:  # _balance_batch's padding step alone: the reorder after it permutes rows, sizes stay
            multiple = trainer._get_required_batch_multiple(dp_size)
            batch = padding_utils.upsample_batch_to_divisible_size(batch, multiple, trainer.tokenizer.eos_token_id)
    finally:
        padding_utils.tq = saved
    return trainer, batch


def actor_update(trainer: SimpleNamespace, batch: KVBatchMeta, value: int) -> Update:
    """verl's ``_update_actor`` with ``actor.ppo_mini_batch_size = value`` for the call, as the mas trainer does."""
    actor = trainer.config.actor_rollout_ref.actor
    configured, actor.ppo_mini_batch_size = actor.ppo_mini_batch_size, value
    batch.extra_info = {}
    try:
        PPOTrainer._update_actor(trainer, batch, metrics={})
    finally:
        actor.ppo_mini_batch_size = configured
    wg = trainer.actor_rollout_wg
    steps = [len(r) for r in wg.records]
    mini_batches = [[batch.keys[i] for r in wg.records for i in r[j]] for j in range(min(steps))]
    return Update(len(batch), value, steps, wg.lr_steps, mini_batches)


def log_prob_pass(trainer: SimpleNamespace, batch: KVBatchMeta, log_prob_micro: int) -> None:
    """verl's ``compute_log_prob`` on the batch: the dp split, then ``TrainingWorker.infer_batch`` per rank."""
    wg = trainer.actor_rollout_wg
    extra = {"calculate_entropy": True, "compute_loss": False, "temperature": 1.0}
    meta = BatchMeta(global_indexes=list(range(len(batch))), partition_ids=["train"] * len(batch), extra_info=extra)
    (chunks,), _ = _split_args_kwargs_data_proto(wg.dp_size, meta)
    for rank, chunk in enumerate(chunks):
        worker = _rank_worker(rank, wg.dp_size, None, 1, [], log_prob_micro=log_prob_micro)
        worker.engine_config.use_dynamic_bsz = False
        data = TensorDict({"row": torch.tensor(chunk.global_indexes)}, batch_size=len(chunk.global_indexes))
        for name, val in chunk.extra_info.items():
            tu.assign_non_tensor_data(tensor_dict=data, key=name, val=val)
        TrainingWorker.infer_batch(worker, data)


def ours(trainer: SimpleNamespace, batch: KVBatchMeta) -> int:
    """The call the mas trainer makes before its update."""
    return update_mini_batch_size(trainer.config, batch, dp_size=actor_dp_size(trainer.actor_rollout_wg))


def run_update(rows: int, train_batch_size: int, mini: int, dp_size: int, *, choose: Any = None, **kw: Any) -> Update:
    """One policy update of ``rows`` rows through verl's code; ``choose(padded_rows, config, dp)`` picks the
    ``actor.ppo_mini_batch_size`` (default: :func:`ppo_mini_batch_size_for`)."""
    trainer, batch = pad_and_balance(rows, train_batch_size, mini, dp_size, **kw)
    value = ours(trainer, batch) if choose is None else choose(len(batch), trainer.config, dp_size)
    return actor_update(trainer, batch, value)


def _check(update: Update, rows: int, epochs: int = 1) -> None:
    """Every rank took the same number of steps; every row, real or padding, is in one mini-batch per epoch;
    every mini-batch holds a real row."""
    assert len(set(update.steps_per_rank)) == 1, update.steps_per_rank  # ranks disagreeing would hang a collective
    assert update.lr_steps_per_rank == [1] * len(update.steps_per_rank)
    counts = Counter(k for mb in update.mini_batches for k in mb)
    assert len(counts) == update.padded_rows and set(counts.values()) == {epochs}
    real = {f"task{i}_0_0" for i in range(rows)}
    assert real <= set(counts)
    assert all(real.intersection(mb) for mb in update.mini_batches), "a mini-batch of padding only"
    sizes = {len(mb) for mb in update.mini_batches}
    assert sizes == {update.padded_rows * epochs // len(update.mini_batches)}


def _old_formula(padded: int, config: Any, dp: int) -> int:
    """``MasTrainer._update_policy_actor`` before this fix (world = dp here: one GPU per rank)."""
    actor, n = config.actor_rollout_ref.actor, int(config.actor_rollout_ref.rollout.n)
    num_mini_batches = max(1, int(config.data.train_batch_size) // int(actor.ppo_mini_batch_size))
    rows = padded // num_mini_batches
    rows -= rows % (dp * n)
    return max(dp, rows // n)


def _rows(dp: int) -> list[int]:
    # one rank micro-batches every row, so dp=1 costs the most and constrains the least (G = n x micro): half as many
    step = 31 if dp == 1 else 17  # every 17th row count: the properties hold row count by row count
    return sorted({*range(1, 400, step), 1, max(1, dp - 1), dp, dp + 1, 2 * dp - 1, 2 * dp + 1})


def _nearest_divisor_steps(padded: int, unit: int, target: int, padding: int) -> int:
    """The documented rule, restated: the divisor s of padded / unit with padded / s > padding nearest target,
    the fewer on a tie."""
    q = padded // unit
    return min((s for s in range(1, q + 1) if q % s == 0 and padded // s > padding), key=lambda s: (abs(s - target), s))


# ---- the three reported crashes ----------------------------------------------------------------------------
# (train, mini, dp, rows, verl's padded rows, old choice, the assertion, mas padded rows, mas choice, choice on
# verl's padding). S = ceil(train / mini); G = lcm(n, dp x micro) = 8 throughout.
CRASHES = [
    # verl pads to lcm(8, 16) = 16: 112. Old: 4 mini-batches, 112 // 4 = 28 -> 24 (multiple of 8), 3 rows per GPU
    # of 14: 14 % 3. Mas: S = 4, pad to S x G = 32: 128, mini-batch 32 (4 per GPU), 4 steps. On 112: steps on offer
    # are the divisors of 112 / 8 = 14; 2 is nearest 4: mini-batch 56.
    (64, 16, 8, 100, 112, 24, "14 % 3 != 0", 128, 32, 56),
    # lcm(8, 32) = 32: 128. Old: 3, 128 // 3 = 42 -> 40, 5 per GPU of 16. Mas: S = 3, pad to 24: 120 (less padding
    # than verl's 128), mini-batch 40 (5 per GPU of 15), 3 steps. On 128: divisors of 16, 2 and 4 tie -> 2: 64.
    (96, 32, 8, 100, 128, 40, "16 % 5 != 0", 120, 40, 64),
    # (100 rows pass here: 120 // 3 = 40.) 130 rows: lcm(8, 40) = 40: 160. Old: 3, 160 // 3 = 53 -> 48, 6 per GPU
    # of 20. Mas: S = 3, pad to 24: 144, mini-batch 48 (6 per GPU of 18), 3 steps. On 160: divisors of 20, 2 and 4
    # tie -> 2: 80.
    (120, 40, 8, 130, 160, 48, "20 % 6 != 0", 144, 48, 80),
]


@pytest.mark.parametrize(
    ("train", "mini", "dp", "rows", "verl_rows", "old", "message", "mas_rows", "mas", "on_verl"), CRASHES
)
def test_reported_crashes(train, mini, dp, rows, verl_rows, old, message, mas_rows, mas, on_verl) -> None:
    # negative control: the old formula, on verl's own padding, trips verl's make_iterator assertion
    with pytest.raises(AssertionError, match=message):
        run_update(rows, train, mini, dp, padding="verl", choose=_old_formula)
    assert _old_formula(verl_rows, _config(train, mini, 1, 1, 1, 1, False), dp) == old

    update = run_update(rows, train, mini, dp, padding="mas")
    assert (update.padded_rows, update.ppo_mini_batch_size) == (mas_rows, mas)
    assert update.steps_per_rank == [train // mini] * dp
    _check(update, rows)

    # without the padding change the rule still runs in verl, with the nearest step count it can offer
    update = run_update(rows, train, mini, dp, padding="verl")
    assert (update.padded_rows, update.ppo_mini_batch_size) == (verl_rows, on_verl)
    assert update.steps_per_rank == [2] * dp
    _check(update, rows)


def test_worked_example_of_the_docstring() -> None:
    kw = dict(train_batch_size=64, ppo_mini_batch_size=16, rollout_n=1, dp_size=8, micro_batch_size_per_gpu=1)
    assert batch_multiple_for(**kw) == 32  # S = 64 / 16 = 4 steps x G = lcm(1, 8 x 1) = 8
    assert ppo_mini_batch_size_for(128, padding_rows=28, **kw) == 32  # 128 / 4, and 32 > 28 padding rows
    # 112 = 8 x 14: steps on offer are the divisors of 14 (1, 2, 7, 14); 2 is 2 from 4, 7 is 3 from it
    assert ppo_mini_batch_size_for(112, padding_rows=12, **kw) == 56
    # a tie: 96/32 on 128 rows (verl's padding), divisors of 16: 2 and 4 are both 1 from S = 3 -> fewer, 2
    kw96 = {**kw, "train_batch_size": 96, "ppo_mini_batch_size": 32}
    assert ppo_mini_batch_size_for(128, padding_rows=28, **kw96) == 64
    # 33 rows padded to 64: 4 mini-batches of 16 could hold only the 31 padding rows; 64 / s > 31 leaves s = 1, 2
    assert ppo_mini_batch_size_for(64, padding_rows=31, **kw) == 32
    assert optimizer_steps_for(16, 3) == 6  # verl pads 16 rows to 18: six mini-batches of 3


# ---- the grid -----------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~1 min of verl's padding, balancing and update arithmetic over the grid
def test_grid_mas_padding_and_verl_padding() -> None:
    """Every (train, mini) x dp x rows: verl's code accepts the choice, covers every row once, and the step
    count is S = ceil(train / mini) with the mas padding, the nearest divisor with verl's own padding."""
    ok = stock_ok = old_fail = balanced = verl_runs = exact = 0
    extra_mas = extra_verl = real_total = verl_real = 0
    for train, mini in PAIRS:
        target = optimizer_steps_for(train, mini)
        for dp in DP_SIZES:
            for i, rows in enumerate(_rows(dp)):
                edge = rows <= 2 * dp + 1
                balance = i % 4 == 0 or edge  # the whole _balance_batch on a quarter of the rows and near dp
                balanced += balance
                mas = run_update(rows, train, mini, dp, padding="mas", balance=balance)
                _check(mas, rows)
                assert mas.padded_rows % (target * dp) == 0
                expected = _nearest_divisor_steps(mas.padded_rows, dp, target, mas.padded_rows - rows)
                assert mas.steps_per_rank[0] == expected, (train, mini, dp, rows, mas)
                exact += expected == target
                ok += 1
                extra_mas += mas.padded_rows - rows
                real_total += rows
                if i % 8 not in (0, 2) and not edge:
                    # verl's own padding on a quarter of the rows, half of them balanced (and on all the edges): the
                    # grid's time is padding
                    continue

                trainer, batch = pad_and_balance(rows, train, mini, dp, padding="verl", balance=balance)
                verl = actor_update(trainer, batch, ours(trainer, batch))
                _check(verl, rows)
                assert verl.steps_per_rank[0] == _nearest_divisor_steps(verl.padded_rows, dp, target, len(batch) - rows)
                ok += 1
                verl_runs += 1
                extra_verl += verl.padded_rows - rows
                verl_real += rows

                stock_ok += _verl_accepts(trainer, batch, mini)  # verl's own setting: fails where mini % dp != 0
                old_fail += not _verl_accepts(trainer, batch, _old_formula(len(batch), trainer.config, dp))
    mas_runs = ok - verl_runs
    print(f"[minibatch] grid {ok} combinations ok ({mas_runs} (train, mini, dp, rows) with the mas padding, "
          f"{verl_runs} with verl's; {balanced} through the whole _balance_batch; verl's own mini-batch size "
          f"runs in {stock_ok})")
    print(f"[minibatch] mas padding: exactly S = ceil(train / mini) steps in {exact} of {mas_runs}; fewer only where "
          "S mini-batches could be padding only (a few rows against the multiple)")
    print(f"[minibatch] the old formula trips verl's assertions in {old_fail} of {verl_runs} combinations")
    print(f"[minibatch] padding rows per update: mas {extra_mas / mas_runs:.1f} ({extra_mas / real_total:.1%} of "
          f"real rows), verl's multiple {extra_verl / verl_runs:.1f} ({extra_verl / verl_real:.1%}); 128 tokens each, "
          "no loss")
    assert old_fail > 0


VARIANTS = [
    # (n, micro per GPU (None: dynamic bsz), Megatron vpp group)
    (1, 2, 1),
    (1, None, 1),
    (4, 2, 1),
    (1, 1, 2),
    (1, None, 2),
]


@pytest.mark.parametrize(("n", "micro", "vpp"), VARIANTS)
@pytest.mark.slow  # a grid through verl's arithmetic (several seconds)
def test_grid_other_settings(n, micro, vpp) -> None:
    """rollout.n, micro-batch size, dynamic batch size, Megatron's virtual pipeline: same properties."""
    ok = refused = 0
    for train, mini in [(64, 16), (120, 40), (16, 3), (4, 4)]:
        target = optimizer_steps_for(train, mini)
        for dp in (2, 8):
            for rows in sorted({*range(1, 400, 131), dp - 1, dp + 1}):
                for padding in ("mas", "verl"):
                    trainer, batch = pad_and_balance(rows, train, mini, dp, n=n, micro=micro, vpp=vpp, padding=padding)
                    try:
                        value = ours(trainer, batch)
                    except ValueError:
                        # only on verl's padding of a setting verl itself cannot run (e.g. 16/3 over 2 ranks with
                        # micro 2): its own mini-batch size fails on the batch too
                        assert padding == "verl" and not _verl_accepts(trainer, batch, mini)
                        refused += 1
                        continue
                    update = actor_update(trainer, batch, value)
                    _check(update, rows)
                    pad = len(batch) - rows
                    if padding == "mas":  # S steps unless S mini-batches could be padding only
                        assert update.steps_per_rank[0] == target or len(batch) // target <= pad
                    ok += 1
    print(f"[minibatch] n={n} micro={micro} vpp={vpp}: {ok} combinations ok, {refused} refused (verl fails them too)")


# ---- optimality and errors, by brute force over every mini-batch size verl could be given ------------------
def _verl_accepts(trainer: SimpleNamespace, batch: KVBatchMeta, mini: int) -> bool:
    """Does verl's code accept ``actor.ppo_mini_batch_size=mini`` for this (already padded) batch?"""
    try:
        actor_update(trainer, batch, mini)
    except (AssertionError, ValueError):
        return False
    return True


def _accepted(rows: int, dp: int, *, n: int = 1, micro: int | None = 1, vpp: int = 1) -> list[int]:
    """Every ``actor.ppo_mini_batch_size`` verl's code accepts on ``rows`` rows that need no padding."""
    trainer, batch = pad_and_balance(rows, rows, 1, dp, n=n, micro=micro, vpp=vpp, padding="none")
    assert len(batch) == rows
    return [m for m in range(1, rows // n + 1) if _verl_accepts(trainer, batch, m)]


@pytest.mark.parametrize(("n", "micro", "vpp"), [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, None, 2)])
@pytest.mark.slow  # a grid through verl's arithmetic (several seconds)
def test_choice_is_the_nearest_verl_accepts(n, micro, vpp) -> None:
    """On rows that are not a multiple of the mas padding, no mini-batch size verl accepts is nearer S."""
    checked = 0
    for dp in (1, 2, 4):
        for padded in range(dp, 49, dp):
            accepted = _accepted(padded, dp, n=n, micro=micro, vpp=vpp)
            kw = dict(
                padding_rows=0, rollout_n=n, dp_size=dp, micro_batch_size_per_gpu=micro, micro_batches_divisible_by=vpp
            )
            for train, mini in ((64, 16), (96, 32), (16, 3)):
                target = optimizer_steps_for(train, mini)
                if not accepted:
                    with pytest.raises(ValueError, match="no PPO mini-batch split|fewer than"):
                        ppo_mini_batch_size_for(padded, train_batch_size=train, ppo_mini_batch_size=mini, **kw)
                    continue
                best = min(accepted, key=lambda m: (abs(padded // (m * n) - target), padded // (m * n)))
                got = ppo_mini_batch_size_for(padded, train_batch_size=train, ppo_mini_batch_size=mini, **kw)
                assert got == best, (dp, padded, train, mini, accepted)
                checked += 1
    print(f"[minibatch] n={n} micro={micro} vpp={vpp}: choice == brute-force nearest over verl-accepted sizes "
          f"in {checked} cases")


def test_raises_only_where_verl_rejects() -> None:
    kw = dict(padding_rows=0, train_batch_size=64, ppo_mini_batch_size=16, rollout_n=1, micro_batch_size_per_gpu=1)
    # 100 rows over 8 ranks: verl never hands these to an update; its balancing rejects them
    with pytest.raises(ValueError, match="do not split over 8 data-parallel ranks"):
        ppo_mini_batch_size_for(100, dp_size=8, **kw)
    with pytest.raises(AssertionError, match="100 % 8 != 0"):
        get_seqlen_balanced_partitions([128] * 100, k_partitions=8, equal_size=True)
    # 6 rows, 2 ranks, micro 2: 3 rows per rank, no multiple of 2 divides 3 (every choice checked in verl)
    with pytest.raises(ValueError, match="must be a multiple of 4 rows"):
        ppo_mini_batch_size_for(6, dp_size=2, **{**kw, "micro_batch_size_per_gpu": 2})
    assert _accepted(6, 2, micro=2) == []
    # rollout.n = 4 and 6 rows: a mini-batch is a multiple of 4 rows, none divides 6
    with pytest.raises(ValueError, match="multiple of 4 rows"):
        ppo_mini_batch_size_for(6, dp_size=1, **{**kw, "rollout_n": 4})
    assert _accepted(6, 1, n=4) == []
    # dynamic bsz, vpp group 4, 2 ranks, 6 rows: 3 per rank < 4
    with pytest.raises(ValueError, match="fewer than 4 rows per data-parallel rank"):
        ppo_mini_batch_size_for(6, dp_size=2, **{**kw, "micro_batch_size_per_gpu": None,
                                                 "micro_batches_divisible_by": 4})
    assert _accepted(6, 2, micro=None, vpp=4) == []


def test_invalid_settings_are_reported_together() -> None:
    with pytest.raises(ValueError) as err:
        ppo_mini_batch_size_for(
            0, padding_rows=-1, train_batch_size=0, ppo_mini_batch_size=-1, rollout_n=True, dp_size=8,
            micro_batch_size_per_gpu=0,
        )
    text = str(err.value)
    for problem in ("train_batch_size is 0", "ppo_mini_batch_size is -1", "rollout_n is True",
                    "micro_batch_size_per_gpu is 0", "rows is 0", "padding_rows is -1"):
        assert problem in text
    with pytest.raises(ValueError, match="padding_rows is 8 of 8 rows"):  # verl pads from a real row
        ppo_mini_batch_size_for(8, padding_rows=8, train_batch_size=8, ppo_mini_batch_size=2, rollout_n=1,
                                dp_size=8, micro_batch_size_per_gpu=1)


def test_no_mini_batch_is_padding_only() -> None:
    """A mini-batch of padding rows only has no loss tokens: verl's token-mean loss is 0/0."""
    assert torch.isnan(agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "token-mean", dp_size=1, batch_num_tokens=0))
    # 33 rows, 64/16 over 8 ranks: padded to 64 (31 padding rows), which verl's balancing puts last on every rank.
    # Negative control: S = 4 mini-batches of 16 leave the last one padding only.
    trainer, batch = pad_and_balance(33, 64, 16, 8, padding="mas")
    real = {f"task{i}_0_0" for i in range(33)}
    forced = actor_update(trainer, batch, 16)
    assert not real.intersection(forced.mini_batches[-1])
    # the rule: 64 / s > 31 leaves s in {1, 2}; 2 mini-batches of 32, each with real rows
    update = actor_update(trainer, batch, ours(trainer, batch))
    assert update.ppo_mini_batch_size == 32
    _check(update, 33)


@pytest.mark.slow  # a grid through verl's arithmetic (several seconds)
def test_log_prob_micro_batches_need_the_padding_too() -> None:
    """Static log-prob micro-batches: each rank's rows must split into them (``compute_log_prob``'s
    ``prepare_micro_batches``); the mas multiple includes ``dp x log_prob_micro_batch_size_per_gpu``."""
    ok = without = 0
    for train, mini in [(64, 16), (120, 40), (16, 3)]:
        for dp in (2, 8):
            for lp in (2, 4, 16):
                for rows in range(1, 200, 13):
                    trainer, batch = pad_and_balance(rows, train, mini, dp, log_prob_micro=lp, balance=False)
                    log_prob_pass(trainer, batch, lp)
                    update = actor_update(trainer, batch, ours(trainer, batch))
                    _check(update, rows)
                    target = optimizer_steps_for(train, mini)
                    assert update.steps_per_rank[0] == target or len(batch) // target <= len(batch) - rows
                    ok += 1
                    # negative control: the multiple without the log-prob term
                    trainer, batch = pad_and_balance(rows, train, mini, dp, balance=False)
                    try:
                        log_prob_pass(trainer, batch, lp)
                    except AssertionError as err:
                        assert "divisible by force_group_size * micro_batch_size_per_gpu" in str(err)
                        without += 1
    print(f"[minibatch] static log-prob micro-batches: {ok} combinations ok; without the log-prob term verl's "
          f"compute_log_prob asserts in {without} of them")
    assert without > 0


def test_epochs_and_shuffle_cover_every_row_once_per_epoch() -> None:
    update = run_update(130, 120, 40, 8, padding="mas", epochs=2, shuffle=True)
    assert update.steps_per_rank == [2 * 3] * 8  # ppo_epochs x S
    _check(update, 130, epochs=2)
    first, second = update.mini_batches[:3], update.mini_batches[3:]
    assert sorted(k for mb in first for k in mb) == sorted(k for mb in second for k in mb)


def test_settings_from_a_verl_config() -> None:
    config = _config(64, 16, 4, 2, 1, 1, False)
    assert mini_batch_settings(config, dp_size=8) == dict(
        train_batch_size=64, ppo_mini_batch_size=16, rollout_n=4, dp_size=8,
        micro_batch_size_per_gpu=2, micro_batches_divisible_by=1,
    )
    assert mini_batch_settings(_config(64, 16, 1, None, 1, 1, False), dp_size=2)["micro_batch_size_per_gpu"] is None
    assert mini_batch_settings(_config(64, 16, 1, 1, 4, 1, False), dp_size=2)["micro_batches_divisible_by"] == 4
    assert math.lcm(4, 8 * 2) * 4 == batch_multiple_for(**mini_batch_settings(config, dp_size=8))
    with_lp = _config(64, 16, 1, 1, 1, 1, False, log_prob_micro=4)
    assert log_prob_micro_batch_sizes(with_lp, use_reference_policy=False) == (4,)
    assert log_prob_micro_batch_sizes(config, use_reference_policy=False) == ()  # dynamic log-prob batches
    # S x G = 4 x 8 = 32; log-prob micro-batches of 4 on each of 8 ranks: lcm(32, 32) = 32
    settings = mini_batch_settings(with_lp, dp_size=8)
    assert batch_multiple_for(**settings, log_prob_micro_batch_sizes_per_gpu=(4,)) == 32
    assert batch_multiple_for(**settings, log_prob_micro_batch_sizes_per_gpu=(32,)) == 256  # lcm(32, 8 x 32)
    # 4 ranks of TP 2 on 8 GPUs: dp is the dispatch's, queried once as _balance_batch does
    wg = SimpleNamespace(_dispatch_info={}, _query_dispatch_info=lambda mesh: [0, 0, 1, 1, 2, 2, 3, 3])
    assert actor_dp_size(wg) == 4 and wg._dispatch_info == {"actor": [0, 0, 1, 1, 2, 2, 3, 3]}
    static_without_micro = _config(64, 16, 1, 1, 1, 1, False)
    static_without_micro.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = None
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_gpu is not set"):
        mini_batch_settings(static_without_micro, dp_size=8)


@pytest.mark.parametrize("kept, before, steps", [(224, 1024, 2), (16, 1024, 1), (1024, 1024, 8), (129, 1024, 2)])
def test_rows_left_by_the_zero_variance_drop_take_fewer_steps_of_the_full_batch_size(kept, before, steps) -> None:
    from verl_mas.minibatch import ROWS_BEFORE_DROP_TAG, dropped_rows_steps

    # 16 tasks a step in mini-batches of 2: stock verl takes 8 steps, of 1024 / 8 = 128 rows for 1024 rows. The
    # kept rows of a dropped batch take ceil(8 * kept / before) steps, through verl's own padding and update.
    assert dropped_rows_steps(8, kept, before) == steps
    trainer, batch = pad_and_balance(kept, 16, 2, 1, tag={ROWS_BEFORE_DROP_TAG: before})
    update = actor_update(trainer, batch, ours(trainer, batch))
    assert update.steps_per_rank == [steps] and all(len(mb) == len(batch) // steps for mb in update.mini_batches)
    # Negative control: the same rows without the tag take stock verl's 8 steps (of a handful of rows each).
    trainer, untagged = pad_and_balance(kept, 16, 2, 1)
    assert actor_update(trainer, untagged, ours(trainer, untagged)).steps_per_rank == [8]
    with pytest.raises(ValueError, match="kept"):
        dropped_rows_steps(8, 0, 10)

"""A CPU rollout backend for verl: ``transformers`` generation behind verl's token-in/token-out contract.

Selected with ``actor_rollout_ref.rollout.name=hf``. The PyPI vLLM and SGLang wheels are CUDA-only, so
on a CPU machine (a laptop, CI) this backend stands in for them with the same contract verl's agent
loops use:

- ``generate(prompt_ids, sampling_params, request_id) -> TokenOutput(token_ids, log_probs,
  stop_reason, extra_fields={"global_steps": int})``: the sampled token ids and their log-probs under
  the sampling distribution (logits divided by the temperature, as verl's actor computes them);
- hybrid weight sync: after every training step verl streams the actor's full weights through
  :class:`HFServerAdapter` (in the trainer worker process) to the server actor, which loads them;
- the lifecycle no-ops verl calls on hybrid replicas (``wake_up``, ``sleep``, ``clear_kv_cache``,
  ``abort_all_requests``, ...).

Concurrency: requests from many agent-loop sessions arrive concurrently; a worker thread (the actor's
event loop stays free) takes the queued requests in arrival order and decodes them together as one
left-padded batch, each row with its own sampling settings and generator, so every request gets its own
answer (the same tokens it would get alone, log-probs equal to float rounding). It is meant for tiny
models; GPU users select vLLM or SGLang as in stock verl.

Diagnostics: ``VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS=1`` makes the server ignore weight updates (the
rollout keeps the initial weights). It exists to prove that verl's rollout-vs-actor probability check
detects a broken weight sync; never set it for training.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger(__name__)

#: Name under which the backend is registered (``actor_rollout_ref.rollout.name=hf``).
from verl_mas.backends.hf_rollout_names import BACKEND_NAME
from verl_mas.policies import rollout_policy
#: Diagnostic switch: ignore weight updates (see the module docstring).
FREEZE_WEIGHTS_ENV = "VERL_MAS_HF_ROLLOUT_FREEZE_WEIGHTS"


# --------------------------------------------------------------------------------------------------
# The generation engine: plain Python, no Ray; testable on its own.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling settings of one request, normalised from verl's ``sampling_params`` dict."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    want_logprobs: bool = True
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "completed" (eos or length) or "aborted"


class HFGenerationEngine:
    """Token-in/token-out generation with a ``transformers`` causal LM; concurrent requests are batched.

    Args:
        model: A causal LM in eval mode.
        eos_token_ids: Token ids that end a response (the tokenizer's and generation config's EOS).
        seed: Seed of the engine's sampling generator (used for requests that bring no seed).
    """

    def __init__(
        self, model: torch.nn.Module, eos_token_ids: Iterable[int], seed: int = 0, max_batch_size: int = 64
    ) -> None:
        self.model = model.eval()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = max_batch_size
        self._generator = torch.Generator().manual_seed(seed)
        # One worker thread owns the model: batches are served in arrival order and never interleave.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-rollout")
        self._lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: list[tuple[list[int], SamplingSettings, asyncio.Future[GenerationResult], Any]] = []
        self._draining = False
        self.largest_batch = 0  # diagnostics: the most requests decoded together so far
        self.frozen = False
        self.num_weight_updates = 0

    @classmethod
    def from_pretrained(cls, path: str, *, seed: int = 0, trust_remote_code: bool = False) -> HFGenerationEngine:
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=trust_remote_code
        )
        eos: set[int] = set()
        try:
            gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json: fall back to the model config
            gen_eos = None
        for value in (gen_eos, model.config.eos_token_id):
            if value is None:
                continue
            eos.update(value if isinstance(value, list) else [value])
        if not eos:
            raise ValueError(
                f"The model at {path!r} declares no eos_token_id (config.json or generation_config.json). "
                "The rollout needs one to end responses; set eos_token_id in the model's config."
            )
        return cls(model, eos, seed=seed)

    # ---- weights ----
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full weights by name; returns the number of tensors loaded.

        Raises:
            ValueError: when a name is not a parameter or buffer of the model (a sync that silently
                skipped weights would leave the rollout off-policy).
        """
        state = {name: tensor for name, tensor in named_tensors}
        if self.frozen:
            logger.warning("%s=1: ignoring a weight update of %d tensors", FREEZE_WEIGHTS_ENV, len(state))
            return 0
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise ValueError(
                f"Weight sync sent {len(unknown)} tensors the rollout model does not have, e.g. {unknown[:3]}. "
                "The actor and the rollout must load the same architecture from actor_rollout_ref.model.path."
            )
        with self._lock, torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor.to(own[name].dtype))
        self.num_weight_updates += 1
        return len(state)

    # ---- generation ----
    async def generate(self, prompt_ids: list[int], settings: SamplingSettings) -> GenerationResult:
        """Generate one response without blocking the event loop.

        Requests that arrive while the model is busy are queued and then decoded together as one
        left-padded batch (at most ``max_batch_size`` rows), each row with its own sampling settings
        and generator; each request gets back exactly its own tokens.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerationResult] = loop.create_future()
        with self._pending_lock:
            self._pending.append((list(prompt_ids), settings, future, loop))
            start = not self._draining
            self._draining = True
        if start:
            loop.run_in_executor(self._executor, self._drain)
        return await future

    def _drain(self) -> None:
        """Worker thread: serve queued requests in arrival order, a batch at a time, until none is left."""
        while True:
            with self._pending_lock:
                batch = self._pending[: self.max_batch_size]
                del self._pending[: self.max_batch_size]
                if not batch:
                    self._draining = False
                    return
            self.largest_batch = max(self.largest_batch, len(batch))
            try:
                results: list[Any] = self.generate_batch([(p, st) for p, st, _, _ in batch])
            except Exception as exc:  # delivered to every waiting request; nothing is swallowed
                results = [exc] * len(batch)
            for (_, _, future, loop), result in zip(batch, results):
                loop.call_soon_threadsafe(_resolve, future, result)

    def generate_sync(self, prompt_ids: list[int], settings: SamplingSettings) -> GenerationResult:
        """Generate one response in the calling thread (the unbatched reference path)."""
        return self.generate_batch([(list(prompt_ids), settings)])[0]

    @torch.no_grad()
    def generate_batch(self, requests: list[tuple[list[int], SamplingSettings]]) -> list[GenerationResult]:
        """KV-cached incremental decoding of several prompts at once (left-padded, per-row settings)."""
        for prompt_ids, _ in requests:
            if not prompt_ids:
                raise ValueError("generate() got an empty prompt; an agent loop must send at least one token id.")
        rows = len(requests)
        width = max(len(p) for p, _ in requests)
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        for i, (prompt_ids, _) in enumerate(requests):
            input_ids[i, width - len(prompt_ids) :] = torch.tensor(prompt_ids)
            mask[i, width - len(prompt_ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [
            torch.Generator().manual_seed(int(st.seed)) if st.seed is not None else self._generator for _, st in requests
        ]
        tokens: list[list[int]] = [[] for _ in range(rows)]
        log_probs: list[list[float]] = [[] for _ in range(rows)]
        done = [False] * rows
        with self._lock:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            next_pos = positions[:, -1] + 1
            while True:
                step_tokens = torch.zeros(rows, dtype=torch.long)
                for i, (prompt_ids, st) in enumerate(requests):
                    if done[i]:
                        continue
                    token, log_prob = self._sample(logits[i], tokens[i], prompt_ids, st, generators[i])
                    tokens[i].append(token)
                    log_probs[i].append(log_prob)
                    step_tokens[i] = token
                    if (token in self.eos_token_ids and not st.ignore_eos) or len(tokens[i]) >= st.max_tokens:
                        done[i] = True
                if all(done):
                    break
                mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)
                out = self.model(
                    input_ids=step_tokens[:, None],
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    past_key_values=past,
                    use_cache=True,
                )
                past, logits = out.past_key_values, out.logits[:, -1].float()
                next_pos = next_pos + 1
        return [GenerationResult(t, lp, "completed") for t, lp in zip(tokens, log_probs)]

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        tokens: list[int],
        prompt_ids: list[int],
        s: SamplingSettings,
        generator: torch.Generator,
    ) -> tuple[int, float]:
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids) | set(tokens)), dtype=torch.long)
            picked = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(picked > 0, picked / s.repetition_penalty, picked * s.repetition_penalty)
        if s.greedy:
            token = int(torch.argmax(logits))
            # Greedy decoding: report the log-prob under the unscaled distribution (temperature 1).
            return token, float(torch.log_softmax(logits, dim=-1)[token])
        scaled = logits / s.temperature
        log_probs = torch.log_softmax(scaled, dim=-1)
        filtered = scaled
        if s.top_k is not None and 0 < s.top_k < filtered.numel():
            kth = torch.topk(filtered, s.top_k).values[-1]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if s.top_p is not None and s.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) > s.top_p  # keep the first token past p
            filtered = filtered.clone()
            filtered[order[drop]] = float("-inf")
        probs = torch.softmax(filtered, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
        # The log-prob under the temperature-scaled distribution: what verl's actor recomputes. With
        # top-k/top-p on, the behaviour policy differs from it; verl's rollout correction handles that.
        return token, float(log_probs[token])


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():  # the caller was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def settings_from_verl(
    sampling_params: dict[str, Any],
    *,
    prompt_len: int,
    response_length: int,
    prompt_length: int,
    max_model_len: int,
    default_ignore_eos: bool = False,
) -> SamplingSettings:
    """Normalise verl's ``sampling_params`` with the same length rules as verl's vLLM server."""
    params = dict(sampling_params)
    max_possible = max_model_len - prompt_len
    if max_possible < 1:
        raise ValueError(
            f"Prompt length ({prompt_len}) leaves no room to generate within the model's maximum context "
            f"length ({max_model_len}). Shorten the prompt or raise rollout.prompt_length/response_length."
        )
    if "max_tokens" in params:
        max_tokens = int(params.pop("max_tokens"))
    elif "max_new_tokens" in params:
        max_tokens = int(params.pop("max_new_tokens"))
    else:
        max_tokens = min(response_length, prompt_length + response_length - prompt_len)
    max_tokens = max(1, min(max_tokens, max_possible))
    top_k = params.get("top_k", -1)
    return SamplingSettings(
        max_tokens=max_tokens,
        temperature=float(params.get("temperature", 1.0)),
        top_k=-1 if top_k is None else int(top_k),
        top_p=float(params.get("top_p", 1.0) if params.get("top_p") is not None else 1.0),
        repetition_penalty=float(params.get("repetition_penalty", 1.0) or 1.0),
        want_logprobs=bool(params.get("logprobs", True)),
        ignore_eos=bool(params.get("ignore_eos", default_ignore_eos)),
        seed=params.get("seed"),
    )


# --------------------------------------------------------------------------------------------------
# The Ray server actor and the replica that launches it.
# --------------------------------------------------------------------------------------------------


def server_actor_name(replica_rank: int, node_rank: int = 0, policy: str | None = None) -> str:
    """The Ray actor name of a replica's server; the worker-side adapter finds its server by it.

    Replica ranks restart at 0 in every worker group, so with several trainable policies (one stack
    each) the policy name, from ``rollout.custom.mas_policy``, keeps the names apart.
    """
    suffix = f"_{policy}" if policy else ""
    return f"{BACKEND_NAME}_server_{replica_rank}_{node_rank}{suffix}"


class HFRolloutServer:
    """The per-replica server actor (wrapped with ``ray.remote`` by :class:`HFReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, node_rank: int = 0) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps = 0
        self.requests_served = 0
        path = getattr(model_config, "local_path", None) or model_config.path
        # Several rollout servers share the machine's cores with the trainer: keep each one small.
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        seed = int(getattr(self.config, "seed", 0) or 0) + replica_rank
        self.engine = HFGenerationEngine.from_pretrained(
            path, seed=seed, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
        self.engine.frozen = os.environ.get(FREEZE_WEIGHTS_ENV, "0").lower() in ("1", "true", "yes")
        if self.engine.frozen:
            logger.warning(
                "%s is set: rollout replica %d will IGNORE weight updates and keep sampling from the "
                "initial weights. This is a diagnostic for the weight-sync check; unset it for training.",
                FREEZE_WEIGHTS_ENV,
                replica_rank,
            )
        self.max_model_len = int(self.config.max_model_len or (self.config.prompt_length + self.config.response_length))

    def get_server_address(self) -> tuple[str, int]:
        # Not an HTTP server: verl uses the address only as a key for its load balancer.
        return f"{BACKEND_NAME}-replica-{self.replica_rank}", self.node_rank

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise NotImplementedError(
                "The hf CPU rollout backend serves text-only models; multimodal inputs need vLLM or SGLang "
                "(actor_rollout_ref.rollout.name=vllm|sglang)."
            )
        settings = settings_from_verl(
            sampling_params,
            prompt_len=len(prompt_ids),
            response_length=self.config.response_length,
            prompt_length=self.config.prompt_length,
            max_model_len=self.max_model_len,
            default_ignore_eos=bool(getattr(self.config, "ignore_eos", False)),
        )
        result = await self.engine.generate([int(t) for t in prompt_ids], settings)
        self.requests_served += 1
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs if settings.want_logprobs else None,
            stop_reason=result.stop_reason,
            extra_fields={"global_steps": int(self.global_steps)},
        )

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], global_steps: int | None = None) -> int:
        loaded = await asyncio.get_running_loop().run_in_executor(
            self.engine._executor, self.engine.load_weights, named_tensors
        )
        if global_steps is not None:
            self.global_steps = int(global_steps)
        return loaded

    def weight_update_count(self) -> int:
        return self.engine.num_weight_updates

    def stats(self) -> dict[str, int]:
        """Counters since start: requests served and weight updates loaded (the trainer logs them per policy)."""
        return {"requests": int(self.requests_served), "weight_updates": int(self.engine.num_weight_updates)}

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = int(global_steps)

    # ---- lifecycle hooks verl calls on hybrid replicas: nothing to free on the CPU ----
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None  # no cache survives a request

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # Requests are short and served FIFO; nothing is partially generated between steps.
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """A rollout replica served by one :class:`HFRolloutServer` (tensor parallel size 1, one node)."""

    async def launch_servers(self) -> None:
        if self.world_size != 1 or self.nnodes != 1:
            raise ValueError(
                f"The hf rollout backend serves one model copy per replica (world size {self.world_size} "
                "requested). Set actor_rollout_ref.rollout.tensor_model_parallel_size=1 "
                "(and data/pipeline parallel sizes 1)."
            )
        options: dict[str, Any] = {
            "name": server_actor_name(self.replica_rank, 0, rollout_policy(self.config)) + self.name_suffix,
            "max_concurrency": self.max_concurrency,
            "num_cpus": 0,  # logical CPU slots stay with verl's workers and TransferQueue
        }
        if self.workers:  # hybrid: run next to the trainer worker that syncs weights into it
            node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        server = (
            ray.remote(HFRolloutServer)
            .options(**options)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank, node_rank=0)
        )
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


# --------------------------------------------------------------------------------------------------
# The worker-side adapter: lives in the trainer worker, pushes weights to the replica's server.
# --------------------------------------------------------------------------------------------------


def iter_full_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Materialise verl's per-tensor weight stream as plain CPU tensors (DTensors are gathered)."""
    for name, tensor in weights:
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach().to("cpu", copy=True)


class HFServerAdapter(BaseRollout):
    """verl's rollout object in the hybrid trainer worker for the ``hf`` backend.

    Every trainer rank consumes the weight stream (gathering sharded parameters is collective); the
    first rank of each replica sends the full tensors to its server actor.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        replica_world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % replica_world
        self._server: Any = None

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank, 0, rollout_policy(self.config)))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None  # weights and cache stay resident on the CPU

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"The hf rollout backend takes full weights (wire_format='named_tensors'), got {wire_format!r}. "
                "Use actor_rollout_ref.rollout.checkpoint_engine.backend=naive with rollout.name=hf."
            )
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError(
                "The hf rollout backend loads merged weights only, but verl sent LoRA adapter weights. "
                "Set actor_rollout_ref.model.lora.merge=True, or use vLLM for unmerged adapters."
            )
        tensors = list(iter_full_tensors(weights))
        if self.rollout_rank != 0:
            return
        start = time.perf_counter()
        loaded = await self._server_handle().update_weights.remote(tensors, global_steps)
        logger.debug("hf rollout replica %d: loaded %d tensors in %.3fs", self.replica_rank, loaded, time.perf_counter() - start)

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError(
            "The hf rollout backend serves verl's async agent-loop mode only (token-in/token-out server)."
        )

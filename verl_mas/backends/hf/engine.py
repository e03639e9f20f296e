"""The ``hf`` backend's generation engine: token-in/token-out decoding with a ``transformers`` causal LM.

Plain Python on torch, no Ray and no verl (the server in :mod:`.server` wraps it), so it is testable on
its own. ``generate`` returns the sampled token ids and their log-probs under the sampling distribution
(logits divided by the temperature, as verl's actor computes them).

Concurrency: requests from many agent-loop sessions arrive concurrently; a worker thread (the caller's
event loop stays free) takes the queued requests in arrival order and decodes them together as one
left-padded batch, each row with its own sampling settings and generator, so every request gets its own
answer (the same tokens it would get alone, log-probs equal to float rounding).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from verl_mas.backends.hf import FREEZE_WEIGHTS_ENV

logger = logging.getLogger(__name__)


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

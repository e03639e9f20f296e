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
from collections.abc import Iterable, Mapping
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
        self._pending: list[tuple[list[int], SamplingSettings, asyncio.Future[GenerationResult], Any, str | None]] = []
        self._draining = False
        self.largest_batch = 0  # diagnostics: the most requests decoded together so far
        #: Diagnostic (``FREEZE_WEIGHTS_ENV``): weight updates after this many loaded ones are ignored (None: none is).
        self.freeze_after: int | None = None
        self.num_weight_updates = 0
        self.weight_bytes_loaded = 0  # bytes of the tensors loaded by weight syncs, in total
        self.adapters: list[str] = []  # LoRA adapters of a shared base, once loaded (load_adapters)
        self.expects_adapters = False  # a shared base: every request must name its adapter

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
    @property
    def frozen(self) -> bool:
        """Whether the next weight update is ignored (the ``FREEZE_WEIGHTS_ENV`` diagnostic)."""
        return self.freeze_after is not None and self.num_weight_updates >= self.freeze_after

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full weights by name; returns the number of tensors loaded.

        Raises:
            ValueError: when a name is not a parameter or buffer of the model (a sync that silently
                skipped weights would leave the rollout off-policy).
        """
        state = {name: tensor for name, tensor in named_tensors}
        if self.frozen:
            logger.warning("%s: ignoring a weight update of %d tensors (%d loaded before it)", FREEZE_WEIGHTS_ENV,
                           len(state), self.num_weight_updates)
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
        self.weight_bytes_loaded += sum(t.numel() * t.element_size() for t in state.values())
        return len(state)

    def load_adapters(self, tensors: Mapping[str, Mapping[str, torch.Tensor]],
                      configs: Mapping[str, Mapping[str, Any]]) -> int:
        """Load every LoRA adapter of a shared base: ``tensors[adapter]`` are its peft state-dict entries
        (``get_peft_model_state_dict`` keys), ``configs[adapter]`` its peft config (``LoraConfig.to_dict()``).

        The first call wraps the model with peft and creates the adapters; the base weights are never touched.

        Raises:
            ValueError: when the adapters differ from the ones created, or an adapter's tensors are not
                exactly its parameters (a sync that skipped or misnamed tensors would leave a role off-policy).
        """
        from peft import PeftConfig, get_peft_model
        from peft.utils.save_and_load import get_peft_model_state_dict, set_peft_model_state_dict

        if self.frozen:
            logger.warning("%s: ignoring an adapter update of %s (%d loaded before it)", FREEZE_WEIGHTS_ENV,
                           sorted(tensors), self.num_weight_updates)
            return 0
        if set(tensors) != set(configs):
            raise ValueError(f"adapter sync: tensors for {sorted(tensors)} but configs for {sorted(configs)}")
        with self._lock, torch.no_grad():
            if not self.adapters:
                names = list(configs)
                model = get_peft_model(self.model, PeftConfig.from_peft_type(**dict(configs[names[0]])),
                                       adapter_name=names[0])
                for name in names[1:]:
                    model.add_adapter(name, PeftConfig.from_peft_type(**dict(configs[name])))
                self.model = model.eval()
                self.adapters = names
            elif set(configs) != set(self.adapters):
                raise ValueError(f"adapter sync sent {sorted(configs)}, but this rollout serves {self.adapters}; the "
                                 "adapters of a shared base are fixed when the run starts.")
            loaded = 0
            for name, state in tensors.items():
                expected = set(get_peft_model_state_dict(self.model, adapter_name=name))
                if set(state) != expected:
                    raise ValueError(
                        f"adapter sync for {name!r}: {len(set(state) - expected)} unknown tensors (e.g. "
                        f"{sorted(set(state) - expected)[:2]}) and {len(expected - set(state))} missing (e.g. "
                        f"{sorted(expected - set(state))[:2]}). The actor and the rollout must build the same adapters."
                    )
                result = set_peft_model_state_dict(self.model, dict(state), adapter_name=name)
                if result.unexpected_keys:
                    raise ValueError(f"adapter sync for {name!r}: peft did not load {result.unexpected_keys[:3]}")
                loaded += len(state)
                self.weight_bytes_loaded += sum(t.numel() * t.element_size() for t in state.values())
        self.num_weight_updates += 1
        return loaded

    # ---- generation ----
    async def generate(self, prompt_ids: list[int], settings: SamplingSettings,
                       adapter: str | None = None) -> GenerationResult:
        """Generate one response without blocking the event loop.

        Requests that arrive while the model is busy are queued and then decoded together as one
        left-padded batch (at most ``max_batch_size`` rows), each row with its own sampling settings
        and generator; each request gets back exactly its own tokens. On a shared LoRA base each request
        names its ``adapter``; the queued requests of one adapter are decoded together.
        """
        self._check_adapter(adapter)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerationResult] = loop.create_future()
        with self._pending_lock:
            self._pending.append((list(prompt_ids), settings, future, loop, adapter))
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
            by_adapter: dict[str | None, list[Any]] = {}
            for item in batch:
                by_adapter.setdefault(item[4], []).append(item)
            for adapter, part in by_adapter.items():
                self.largest_batch = max(self.largest_batch, len(part))
                try:
                    results: list[Any] = self.generate_batch([(p, st) for p, st, _, _, _ in part], adapter=adapter)
                except Exception as exc:  # delivered to every waiting request; nothing is swallowed
                    results = [exc] * len(part)
                for (_, _, future, loop, _), result in zip(part, results):
                    loop.call_soon_threadsafe(_resolve, future, result)

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is None and self.expects_adapters:
            raise ValueError(
                "This rollout serves a shared LoRA base; a request without an adapter would be answered by the bare "
                "base. The mas agent loop names each role's adapter; a request from elsewhere must pass adapter=<policy>."
            )
        if adapter is not None and not self.adapters:
            raise ValueError(
                f"A request asked for adapter {adapter!r}, but this rollout has no adapters loaded"
                + (" yet (the trainer syncs them before the first rollout)." if self.expects_adapters else
                   " (it serves one model; adapters come with mas.lora_base=shared).")
            )
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"A request asked for adapter {adapter!r}; this rollout serves {self.adapters}.")

    def generate_sync(self, prompt_ids: list[int], settings: SamplingSettings,
                      adapter: str | None = None) -> GenerationResult:
        """Generate one response in the calling thread (the unbatched reference path)."""
        self._check_adapter(adapter)
        return self.generate_batch([(list(prompt_ids), settings)], adapter=adapter)[0]

    @torch.no_grad()
    def generate_batch(self, requests: list[tuple[list[int], SamplingSettings]],
                       adapter: str | None = None) -> list[GenerationResult]:
        """KV-cached incremental decoding of several prompts at once (left-padded, per-row settings), with
        ``adapter`` active on a shared LoRA base."""
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
            if adapter is not None:
                self.model.set_adapter(adapter)
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

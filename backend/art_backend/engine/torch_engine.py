"""The embedded engine: continuous batching over `LeanLlama` on CPU or one GPU.

One worker thread owns the model. Each iteration it admits waiting requests (prefilling
only what no cached prefix covers), then runs one decode step for every active sequence
together, so concurrent requests share forward passes. Finished sequences leave their KV
in a prefix store, so the next turn of a conversation, or the other rollouts of a group that
share a prompt, prefill only their new tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llguidance
# llguidance.numpy, not llguidance.torch: the torch module decorates a kernel we do not use with
# torch.compile, whose import (torch._dynamo, sympy, networkx) was ~40% of a backend's start
import llguidance.numpy
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from art_backend.chat_format import ChatFormatter
from art_backend.config import PREFIX_CACHE_BYTES, PREFIX_CACHE_IDLE_SECONDS
from art_backend.engine.base import GenerationRequest, SequenceDelta, TokenLogprob, end_of_turn_ids, is_base_model
from art_backend.engine.host_memory import return_freed_memory_to_os, reusing_freed_memory
from art_backend.engine.llama import LORA_TARGETS, LeanLlama, LoraWeights
from art_backend.engine.sampling import Penalties, RowSampling, sample
from art_backend.errors import ContextLengthError, DamagedCheckpointError, InvalidSamplingError, ModelNotServedError
from art_backend.grammar import Constrainer, GrammarError
from art_backend.training.tokenize import TrainSequence
from art_integrations.training import LoraConfig, TrainConfig

if TYPE_CHECKING:  # imported at the first step: peft (and accelerate) cost a serve-only process ~1 s
    from art_backend.training.trainer import LoraTrainer

logger = logging.getLogger(__name__)

_MAX_CONTEXT = 8192


# the fewest prompt tokens whose keys and values a sequence reads from another's slot
_MIN_SHARED_KV = 64


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class _Request:
    spec: GenerationRequest
    adapter: LoraWeights | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[SequenceDelta] | BaseException]
    aborted: bool = False


@dataclass(eq=False)
class _Sequence:
    request: _Request
    index: int
    ids: list[int]  # prompt + completion; the cache holds KV for all but the last
    completion: list[int]
    rows: RowSampling
    matcher: llguidance.LLMatcher | None = None  # the grammar the output must follow
    penalties: Penalties | None = None
    pending: list[TokenLogprob] = field(default_factory=list)  # not yet sent
    text: str = ""
    sent_text: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    # an active sequence whose slot holds this one's first `shared` keys and values too (the
    # same tokens, adapter and so numbers): decode steps read them there (`_shared_kv`)
    leader: _Sequence | None = None
    shared: int = 0


@dataclass(frozen=True)
class _Unread:
    """An adapter served by name but read from `path` only when first asked for."""

    path: Path


@dataclass
class _PrefixEntry:
    adapter: LoraWeights | None
    k: torch.Tensor
    v: torch.Tensor


# a cached KV prefix: its length, and who holds it (an active sequence or a prefix-store key)
_PrefixHit = tuple[int, _Sequence | tuple[int, ...] | None]


class TorchEngine:
    """Serves a local Hugging Face model directory (see `Engine` for the interface)."""

    def __init__(self, model_dir: Path, served_model_name: str | None = None, aliases: Sequence[str] = (),
                 max_model_len: int | None = None, max_batch_size: int = 64,
                 prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
                 prefix_cache_idle_seconds: float = PREFIX_CACHE_IDLE_SECONDS, threads: int | None = None,
                 dtype: str = "float32", cpu_kernels: bool = True, tune_process_memory: bool = False) -> None:
        """`prefix_cache_bytes`, `prefix_cache_idle_seconds`: the store of finished turns' KV, and
        how long it is kept once no request is left (inf: until pushed out). `dtype`: the serving
        forward's weights and matmuls (see `LeanLlama`); on GPU always the model's bfloat16.
        `cpu_kernels`: decode with the fused kernels of `cpu_kernels.cpp`. `tune_process_memory`: change
        this process's host memory handling for the engine's sake (host_memory.py); only for a process
        the backend owns, or where its user asked."""
        if tune_process_memory:
            return_freed_memory_to_os()  # else the process keeps its peak after each step
        self._tune_process_memory = tune_process_memory
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.base_model_name = served_model_name or Path(model_dir).name
        self.base_model_aliases = tuple(dict.fromkeys(a for a in aliases if a != self.base_model_name))
        self.max_batch_size = max_batch_size
        self.constrainer = Constrainer(self.tokenizer)
        self.peak_batch_size = 0  # most sequences decoded in one step so far
        # None: the base model under another name; _Unread: an adapter not read yet
        self._adapters: dict[str, LoraWeights | _Unread | None] = {}
        self._trainer: LoraTrainer | None = None
        self._active: list[_Sequence] = []
        self._waiting: deque[_Request] = deque()
        self._jobs: deque[tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]] = deque()
        self._prefixes: OrderedDict[tuple[int, ...], _PrefixEntry] = OrderedDict()
        self._prefix_tokens = 0
        self._prefix_cache_bytes = prefix_cache_bytes
        self._prefix_idle_seconds = prefix_cache_idle_seconds
        self._wake = threading.Condition()
        self._closed = False
        # All of the engine's torch work runs on this one thread, loading included: GNU OpenMP
        # keeps a thread team per calling thread, and with a second team alive on the machine's
        # cores its threads stop spinning between parallel regions, so each of a decode step's
        # ~200 small parallel kernels waits for its threads to wake (a 16-row step ~40% slower).
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        load = functools.partial(self._load, model_dir, max_model_len, threads, dtype, cpu_kernels)
        self._worker = threading.Thread(target=self._run, args=(load, loaded), name="art-torch-engine", daemon=True)
        self._worker.start()
        loaded.result()  # raises what loading raised

    def _load(self, model_dir: Path, max_model_len: int | None, threads: int | None, dtype: str,
              cpu_kernels: bool) -> None:
        if threads:
            torch.set_num_threads(threads)
        model_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model_dtype).to(self.device).eval()
        config = self.model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        if max_model_len is None:
            self.max_model_len = min(self.max_model_len, _MAX_CONTEXT)
        self.lean = LeanLlama(self.model, self.max_model_len,
                              dtype=None if self.device.type == "cuda" else getattr(torch, dtype),
                              fused_kernels=cpu_kernels)
        self.stop_ids = end_of_turn_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        # merged copies only at full precision (in bf16 a small W + B A delta would round away) and
        # over float32 layouts: exact integer groups plus the unmerged delta decode faster than a
        # merged float32 copy (embedded model, 16 rows: 439 against 331 tok/s)
        self._merge_adapters = self.lean.weights_dtype == torch.float32 and not self.lean.grouped_matrices
        # the kernels' allocator that reuses freed blocks within a step or a prefill, where allowed
        self._step_memory = self.lean.kernels if self._tune_process_memory else None
        self._cache = self.lean.new_cache()
        self._prefix_budget = self._prefix_cache_bytes // self._cache.bytes_per_token
        logger.info("Loaded %s in %.1f s on %s (serving weights %s, %s)", model_dir, time.perf_counter() - started,
                    self.device, self.lean.weights_layout(), "fused decode kernels" if self.lean.kernels is not None
                    else "eager decode ops")

    # ----- the Engine interface ---------------------------------------------------------

    def served_models(self) -> list[str]:
        return [self.base_model_name, *self.base_model_aliases, *self._adapters]

    async def load_adapter(self, name: str, path: Path | None, preload: bool = True) -> None:
        """Serve the adapter at `path` (None: the base model) as `name`. The adapter loaded last
        also gets merged weights where they are faster (see `LeanLlama.merge`): the rollouts of a
        training run, which all use the newest checkpoint, then decode as fast as the base model.
        `preload=False`: read at the first request for `name`, and never merged."""
        def load() -> None:
            if path is None:
                self._set_adapter(name, None)
            elif preload:
                self._set_adapter(name, self._adapter_at(Path(path).resolve()))
            else:
                self._adapters[name] = _Unread(Path(path).resolve())

        await self._on_worker(load)

    def _read_on_first_use(self, name: str) -> LoraWeights:
        entry = self._adapters[name]
        if isinstance(entry, _Unread):
            served = (w for w in list(self._adapters.values()) if isinstance(w, LoraWeights) and w.source == entry.path)
            self._adapters[name] = next(served, None) or self._read_adapter(entry.path)
        weights = self._adapters[name]
        assert isinstance(weights, LoraWeights)
        return weights

    def _adapter_at(self, path: Path) -> LoraWeights:
        """The adapter already served from `path` (a checkpoint served under two names is one
        adapter: its rows batch and share cached prefixes), else the one read from there; with
        merged weights unless the serving layout rules them out."""
        served = (w for w in list(self._adapters.values()) if isinstance(w, LoraWeights) and w.source == path)
        weights = next(served, None) or self._read_adapter(path)
        if self._merge_adapters and weights.merged is None:
            weights.merged = self.lean.merge(weights)
        return weights

    def _set_adapter(self, name: str, weights: LoraWeights | None) -> None:
        if weights is not None and weights.merged is not None:
            for other in self._adapters.values():
                if isinstance(other, LoraWeights) and other is not weights:
                    other.merged = None  # one merged copy at a time: it is as large as the weights
        self._adapters[name] = weights

    async def remove_adapter(self, name: str) -> None:
        await self._on_worker(lambda: self._adapters.pop(name, None))

    def check_lora(self, lora: LoraConfig) -> None:
        unknown = sorted(set(lora.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"LoRA on {', '.join(unknown)} cannot be served; target modules: {', '.join(LORA_TARGETS)}.")

    def chat_formatter(self, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatFormatter:
        return ChatFormatter(self.tokenizer, tool_call_parser, reasoning_parser)

    async def train_step(self, model_name: str, sequences: list[TrainSequence], config: TrainConfig,
                         lora: LoraConfig, resume_from: Path | None, save_to: Path) -> dict[str, float]:
        asked = time.perf_counter()

        def step() -> dict[str, float]:
            waited = time.perf_counter() - asked
            return {**self._ensure_trainer().step(model_name, sequences, config, lora, resume_from, save_to),
                    "wait_seconds": waited}

        return await self._on_worker(step)

    async def sft_step(self, model_name: str, batches: list[list[TrainSequence]], learning_rates: list[float],
                       config: TrainConfig, lora: LoraConfig, resume_from: Path | None,
                       save_to: Path) -> dict[str, float]:
        asked = time.perf_counter()

        def step() -> dict[str, float]:
            waited = time.perf_counter() - asked
            return {**self._ensure_trainer().sft_step(model_name, batches, learning_rates, config, lora, resume_from, save_to),
                    "wait_seconds": waited}

        return await self._on_worker(step)

    def _ensure_trainer(self) -> LoraTrainer:
        """The trainer, made at the first step (on the worker thread)."""
        if self._trainer is None:
            from art_backend.training.trainer import LoraTrainer

            self._trainer = LoraTrainer(self.model, step_memory=self._step_memory)
        return self._trainer

    async def _on_worker(self, job: Callable[[], Any]) -> Any:
        """Run `job` on the worker thread between decode steps: decoding pauses meanwhile (queued
        requests just wait), and the job's memory comes from the same allocator arena as
        decoding's rather than from a fresh thread's, which would keep it all reserved."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._wake:
            self._jobs.append((job, future, loop))
            self._wake.notify()
        return await future

    async def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        await asyncio.to_thread(self._worker.join)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceDelta]:
        adapter = self.resolve_adapter(request.model)
        if isinstance(adapter, _Unread):
            adapter = await self._on_worker(lambda: self._read_on_first_use(request.model))
        total = len(request.prompt_ids)
        if request.params.grammar is not None:
            self.constrainer.check(request.params.grammar)
        if total + request.params.max_tokens > self.max_model_len:
            raise ContextLengthError.over(self.max_model_len, total, request.params.max_tokens)
        state = _Request(request, adapter, asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            self._waiting.append(state)
            self._wake.notify()
        remaining = request.n
        try:
            while remaining:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    remaining -= delta.finish_reason is not None
                    yield delta
        finally:
            state.aborted = remaining > 0

    def resolve_adapter(self, model: str | None) -> LoraWeights | _Unread | None:
        """The adapter a request for `model` runs with (None: the base model; `_Unread`: not read yet)."""
        if is_base_model(self, model):
            return None
        if model in self._adapters:
            return self._adapters[model]
        raise ModelNotServedError.unknown(model, self.served_models())

    # ----- adapters ---------------------------------------------------------------------

    def _read_adapter(self, path: Path) -> LoraWeights:
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            rank, alpha = config["r"], config["lora_alpha"]
            tensors = load_file(str(path / "adapter_model.safetensors"), device=str(self.device))
        except Exception as error:  # noqa: BLE001 - every way the files fail to load is damage
            raise DamagedCheckpointError(f"The adapter at {path} does not load: {type(error).__name__}: {error}") \
                from error
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        a: dict[tuple[int, str], torch.Tensor] = {}
        b: dict[tuple[int, str], torch.Tensor] = {}
        dtype = self.lean.dtype
        for key, tensor in tensors.items():
            # e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
            parts = key.split(".")
            if "layers" not in parts or parts[-2] not in ("lora_A", "lora_B"):
                raise ValueError(f"{path}: unexpected adapter tensor {key}; only LoRA on linear layers is served.")
            layer, module = int(parts[parts.index("layers") + 1]), parts[-3]
            if module not in LORA_TARGETS:
                raise ValueError(f"{path}: LoRA on {module} is not supported; targets: {LORA_TARGETS}.")
            if parts[-2] == "lora_A":
                a[(layer, module)] = tensor.to(dtype)
            else:
                b[(layer, module)] = (tensor * scale).to(dtype)
        weights = self.lean.fuse_lora(a, b)
        weights.source = path
        return weights

    # ----- the worker thread ------------------------------------------------------------

    def _run(self, load: Callable[[], None], loaded: concurrent.futures.Future[None]) -> None:
        try:
            load()
        except BaseException as error:  # the constructor re-raises it
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        while True:
            with self._wake:
                while not self._closed and not self._waiting and not self._active and not self._jobs:
                    if not self._wake.wait(self._idle_wait()):
                        self._forget_prefixes()
                if self._closed:
                    break
            self._run_jobs()
            try:
                # a prefill's layers free and remake the same sizes (a decode step's tensors are
                # too small to gain: measured, the main job ran no faster)
                if self._waiting:
                    with reusing_freed_memory(self._step_memory):
                        self._admit()
                if self._active:
                    self._decode_step()
                if not self._active:
                    self._cache.release()
            except Exception as error:  # a failed step fails its requests, never the server
                logger.exception("Engine step failed; failing the %d active sequences", len(self._active))
                self._fail_active(error)
        for seq in self._active:
            self._send(seq.request, RuntimeError("The engine was closed."))

    def _idle_wait(self) -> float | None:
        """How long the idle worker waits before dropping the prefix store (None: for the next request)."""
        return None if not self._prefixes or math.isinf(self._prefix_idle_seconds) else self._prefix_idle_seconds

    def _forget_prefixes(self) -> None:
        logger.info("Dropped the %d kept prefixes (%.0f MiB of KV) after %.0f s without a request",
                    len(self._prefixes), self._prefix_tokens * self._cache.bytes_per_token / 2**20,
                    self._prefix_idle_seconds)
        self._prefixes.clear()
        self._prefix_tokens = 0

    def _run_jobs(self) -> None:
        while self._jobs:
            job, future, loop = self._jobs.popleft()
            try:
                result = job()
            except Exception as error:  # the job's caller gets the error; the engine goes on
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

    def _send(self, request: _Request, item: list[SequenceDelta] | BaseException) -> None:
        try:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is left to read this
            logger.warning("Dropping output of a request whose event loop has closed")
            request.aborted = True

    def _fail_active(self, error: Exception) -> None:
        failed = {id(s.request): s.request for s in self._active}
        self._active.clear()
        for request in failed.values():
            self._send(request, error)

    def _admit(self) -> None:
        """Prefill waiting requests, as many together as fit, until none is left."""
        while self._waiting:
            batch = self._next_prefill_batch()
            if not batch:
                return
            try:
                self._prefill(batch)
            except Exception as error:
                logger.exception("Prefill failed")
                failed = {id(request) for request, _ in batch}
                self._active = [s for s in self._active if id(s.request) not in failed]
                for request, _ in batch:
                    self._send(request, error)

    def _next_prefill_batch(self) -> list[tuple[_Request, _PrefixHit]]:
        """Waiting requests to prefill in one forward, in arrival order. The batch ends before a
        request that shares more of its prompt with one already taken than any cached KV covers
        (next batch, it reuses that KV instead of recomputing it: a group's rollouts share their
        prompt), or whose padding would make over half of the forward's tokens padding. Each
        request comes with the cached KV prefix it will reuse."""
        batch: list[tuple[_Request, _PrefixHit]] = []
        seats, new_tokens, widest = len(self._active), 0, 0
        with self._wake:
            for request in list(self._waiting):
                if request.aborted:
                    self._waiting.remove(request)
                    continue
                if (self._active or batch) and seats + request.spec.n > self.max_batch_size:
                    break
                prompt = request.spec.prompt_ids
                hit = self._find_prefix(prompt, request.adapter)
                cached = hit[0]
                shared = max((_common_prefix(other.spec.prompt_ids, prompt) for other, _ in batch
                              if other.adapter is request.adapter), default=0)
                shared = min(shared, len(prompt) - 1)  # the last token is recomputed anyway
                if shared > 1 and shared > cached:
                    break
                new = len(prompt) - cached
                if batch and (len(batch) + 1) * max(widest, new) > 2 * (new_tokens + new):
                    break
                self._waiting.remove(request)
                batch.append((request, hit))
                seats, new_tokens, widest = seats + request.spec.n, new_tokens + new, max(widest, new)
        return batch

    def _prefill(self, batch: list[tuple[_Request, _PrefixHit]]) -> None:
        """One forward over the new prompt tokens of every request in `batch` (rows padded to
        the longest), then the first sampled token of each of their `n` sequences."""
        states = {}
        for request, _ in batch:  # one request's bad settings fail that request, never its batch
            try:
                states[id(request)] = [self._sampling_state(request, index) for index in range(request.spec.n)]
            except Exception as error:  # noqa: BLE001 - handed to its request, which raises it
                self._send(request, error)
        batch = [(request, hit) for request, hit in batch if id(request) in states]
        if not batch:
            return
        first_slot = len(self._active)
        slots, starts, prompts = [], [], []
        slot = first_slot
        for request, hit in batch:
            prompt = request.spec.prompt_ids
            self._cache.reserve(slot + request.spec.n, len(prompt) + 1)
            slots.append(slot)
            starts.append(self._copy_prefix(hit, slot))
            prompts.append(prompt)
            slot += request.spec.n
        steps = max(len(p) - start for p, start in zip(prompts, starts))
        # padding continues each row's positions (its KV lands past the row's length, where the
        # row's own later tokens overwrite it before anything attends to it)
        self._cache.reserve(slot, max(starts) + steps)
        positions = torch.tensor([[min(start + t, self.max_model_len - 1) for t in range(steps)] for start in starts],
                                 device=self.device)
        tokens = torch.tensor([p[start:] + [0] * (steps - len(p) + start) for p, start in zip(prompts, starts)],
                              device=self.device)
        hidden = self.lean.forward(tokens, positions, torch.tensor(slots, device=self.device), self._cache,
                                   torch.tensor([len(p) for p in prompts], device=self.device),
                                   self._lora([request.adapter for request, _ in batch]))
        last = torch.tensor([len(p) - start - 1 for p, start in zip(prompts, starts)], device=self.device)
        logits = self.lean.logits(hidden[torch.arange(len(batch), device=self.device), last])
        for (request, _), slot, prompt in zip(batch, slots, prompts):
            for index, (rows, matcher, penalties) in enumerate(states[id(request)]):
                if index:
                    self._cache.move(slot, slot + index, len(prompt))
                self._active.append(_Sequence(request, index, list(prompt), [], rows, matcher, penalties))
        row_of_request = [row for row, (request, _) in enumerate(batch) for _ in range(request.spec.n)]
        if self.lean.kernels is not None:
            for seq in self._active[first_slot:]:
                self._find_leader(seq)
        self._accept(self._active[first_slot:], logits[row_of_request])

    def _sampling_state(self, request: _Request, index: int) -> tuple[RowSampling, llguidance.LLMatcher | None,
                                                                        Penalties | None]:
        params = request.spec.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        rows = RowSampling(params.temperature, params.top_p, params.top_logprobs, generator, params.top_k, params.min_p)
        matcher = self.constrainer.matcher(params.grammar) if params.grammar is not None else None
        penalties = Penalties.for_prompt(request.spec.prompt_ids, params.frequency_penalty, params.presence_penalty,
                                         params.repetition_penalty, params.logit_bias)
        return rows, matcher, penalties

    def _find_prefix(self, tokens: list[int], adapter: LoraWeights | None) -> _PrefixHit:
        """The longest KV prefix of `tokens` held by an active sequence or the prefix store (at
        most all but the last token: its logits choose the first new token), and its holder."""
        best, source = 0, None
        for seq in self._active:
            if seq.request.adapter is adapter:
                n = _common_prefix(seq.ids[:-1], tokens)
                if n > best:
                    best, source = n, seq
        for key, entry in self._prefixes.items():
            if entry.adapter is adapter and len(key) > best:
                n = _common_prefix(list(key), tokens)
                if n > best:
                    best, source = n, key
        return min(best, len(tokens) - 1), source

    def _copy_prefix(self, hit: _PrefixHit, slot: int) -> int:
        """Copy a prefix found by `_find_prefix` into `slot`; return its length."""
        best, source = hit
        if best <= 0:
            return 0
        if isinstance(source, _Sequence):
            self._cache.move(self._active.index(source), slot, best)
        else:
            entry = self._prefixes[source]
            self._prefixes.move_to_end(source)
            self._cache.load(slot, entry.k, entry.v, best)
        return best

    def _find_leader(self, seq: _Sequence) -> None:
        """The active sequence sharing the longest start of `seq`'s prompt (and its adapter), at
        least `_MIN_SHARED_KV` tokens, or none: a group's rollouts, and the requests that start
        with the same system prompt and tools."""
        seq.leader, seq.shared = None, 0
        prompt = seq.ids[:-1]  # the last prompt token's keys are its own step's
        for other in self._active:
            if other is not seq and other.request.adapter is seq.request.adapter:
                n = _common_prefix(other.ids[:-1], prompt)
                if n >= _MIN_SHARED_KV and n > seq.shared:
                    seq.leader, seq.shared = other, n

    def _shared_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a decode step: each row's leader's slot and how many keys it reads there (its own
        slot and 0 without one); a leader that has finished is replaced first."""
        if self.lean.kernels is None:
            return None
        slot_of = {id(seq): slot for slot, seq in enumerate(self._active)}
        slots, lengths = [], []
        for slot, seq in enumerate(self._active):
            if seq.leader is not None and id(seq.leader) not in slot_of:
                self._find_leader(seq)
            leader = seq.leader
            slots.append(slot if leader is None else slot_of[id(leader)])
            lengths.append(0 if leader is None else seq.shared)
        return (torch.tensor(slots, device=self.device), torch.tensor(lengths, device=self.device))

    def _lora(self, adapters: list[LoraWeights | None]) -> list[LoraWeights | None] | None:
        return adapters if any(a is not None for a in adapters) else None

    def _decode_step(self) -> None:
        active = self._active
        batch = len(active)
        self.peak_batch_size = max(self.peak_batch_size, batch)
        lengths = [len(s.ids) for s in active]
        self._cache.reserve(batch, max(lengths))
        tokens = torch.tensor([[s.ids[-1]] for s in active], device=self.device)
        positions = torch.tensor([[n - 1] for n in lengths], device=self.device)
        hidden = self.lean.forward(tokens, positions, torch.arange(batch, device=self.device), self._cache,
                                   torch.tensor(lengths, device=self.device),
                                   self._lora([s.request.adapter for s in active]), self._shared_kv())
        self._accept(active, self.lean.logits(hidden[:, -1]))

    def _accept(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs`, update their text, send deltas, retire the finished."""
        penalized = [row for row, seq in enumerate(seqs) if seq.penalties is not None]
        for row in penalized:
            seqs[row].penalties.apply(logits[row])  # type: ignore[union-attr]
        # only penalties can make logits NaN or +inf; such a request fails alone
        finite = torch.isfinite(logits[penalized].amax(dim=-1)).tolist() if penalized else []
        broken = [seqs[row] for row, ok in zip(penalized, finite) if not ok]
        for seq in broken:
            if not seq.request.aborted:
                params = seq.request.spec.params
                self._send(seq.request, InvalidSamplingError(
                    f"The sampling settings make this request's logits non-finite (repetition_penalty="
                    f"{params.repetition_penalty}, frequency_penalty={params.frequency_penalty}, presence_penalty="
                    f"{params.presence_penalty}): use values nearer 1.0 (repetition) or 0.0 (the others)."))
            seq.request.aborted = True
            seq.finish_reason = "abort"
        if broken:
            logits = logits.nan_to_num(nan=0.0, posinf=0.0)  # the aborted rows' draws are thrown away
        sampled = sample(logits, [s.rows for s in seqs], self._allowed_tokens(seqs, logits.shape[-1]),
                         self.lean.kernels)
        by_request: dict[int, list[SequenceDelta]] = {}
        for seq, token, logprob, top in zip(seqs, sampled.token_ids, sampled.logprobs, sampled.top):
            matcher = seq.matcher
            if matcher is not None and (matcher.is_error() or (not matcher.is_stopped()
                                                                and not matcher.consume_token(token))):
                # the grammar's parser gave up (a schema with no finite instance, say): this request fails alone
                error = GrammarError(f"The requested structure cannot be enforced: {matcher.get_error()}")
                self._send(seq.request, error)
                seq.request.aborted = True
                seq.finish_reason = "abort"
                continue
            if seq.penalties is not None:
                seq.penalties.record(token)
            seq.ids.append(token)
            seq.completion.append(token)
            seq.pending.append(TokenLogprob(token, logprob, top))
            self._update_text(seq, token)
            if seq.request.aborted:
                seq.finish_reason = "abort"
            delta = self._delta(seq)
            if delta is not None:
                by_request.setdefault(id(seq.request), []).append(delta)
        for seq in seqs:
            if seq.request.aborted:
                continue
            deltas = by_request.pop(id(seq.request), None)
            if deltas:
                self._send(seq.request, deltas)
        self._retire()

    def _allowed_tokens(self, seqs: list[_Sequence], vocab: int) -> torch.Tensor | None:
        """[rows, vocab] bool: what each row's grammar allows (rows without one: everything); None
        when no row has a grammar."""
        constrained = [(row, s.matcher) for row, s in enumerate(seqs) if s.matcher is not None]
        if not constrained:
            return None
        words = llguidance.numpy.allocate_token_bitmask(len(seqs), self.constrainer.tokenizer.vocab_size)
        bitmask = torch.from_numpy(words)  # the same memory
        for row, matcher in constrained:
            if not matcher.is_stopped():
                llguidance.numpy.fill_next_token_bitmask(matcher, words, row)
            if matcher.is_stopped() or matcher.is_error():  # complete (or failed, see _accept): end the turn
                bitmask[row] = 0
                bitmask[row, self.tokenizer.eos_token_id // 32] = 1 << (self.tokenizer.eos_token_id % 32)
        # unpack 32 tokens per int32 word (unconstrained rows stay all ones)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(seqs), -1)[:, :vocab].bool().to(self.device)
        if allowed.shape[-1] < vocab:  # padded model vocabularies: the extra ids are never valid
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]))
        return allowed

    def _update_text(self, seq: _Sequence, token: int) -> None:
        params = seq.request.spec.params
        if token in self.stop_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            # incremental detokenization: decode a short window so multi-byte characters and
            # leading-space tokens come out right without re-decoding the whole completion
            skip = params.skip_special_tokens
            window = self.tokenizer.decode(seq.completion[seq.prefix_offset:], skip_special_tokens=skip)
            before = self.tokenizer.decode(seq.completion[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
            if len(window) > len(before) and not window.endswith("\ufffd"):
                old_length = len(seq.text)
                seq.text += window[len(before):]
                seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.completion)
                for stop in params.stop:
                    at = seq.text.find(stop, max(0, old_length - len(stop) + 1))
                    if at >= 0:
                        seq.text, seq.finish_reason = seq.text[:at], "stop"
                        return
            if len(seq.completion) >= params.max_tokens or len(seq.ids) >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason:  # flush a character the window still held back (the end-of-turn token is no text)
            ids = seq.completion[:-1] if seq.finish_reason == "stop" and token in self.stop_ids else seq.completion
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _delta(self, seq: _Sequence) -> SequenceDelta | None:
        stops = seq.request.spec.params.stop
        # hold back text that could be the start of a stop string
        hold = 0 if seq.finish_reason else max((len(s) - 1 for s in stops), default=0)
        upto = max(seq.sent_text, len(seq.text) - hold)
        if not seq.pending and upto == seq.sent_text and seq.finish_reason is None:
            return None
        delta = SequenceDelta(
            index=seq.index,
            token_ids=[t.token_id for t in seq.pending],
            logprobs=seq.pending,
            text=seq.text[seq.sent_text:upto],
            finish_reason=seq.finish_reason,
        )
        seq.pending, seq.sent_text = [], upto
        return delta

    def _retire(self) -> None:
        for seq in [s for s in self._active if s.finish_reason]:
            slot = self._active.index(seq)
            self._remember_prefix(seq, slot)
            last = len(self._active) - 1
            if slot != last:
                self._cache.move(last, slot, len(self._active[last].ids) - 1)
                self._active[slot] = self._active[last]
            self._active.pop()

    def _remember_prefix(self, seq: _Sequence, slot: int) -> None:
        length = len(seq.ids) - 1
        key = tuple(seq.ids[:length])
        if length < 2 or key in self._prefixes or length > self._prefix_budget:
            return
        k, v = self._cache.export(slot, length)
        self._prefixes[key] = _PrefixEntry(seq.request.adapter, k, v)
        self._prefix_tokens += length
        while self._prefix_tokens > self._prefix_budget:
            old, _ = self._prefixes.popitem(last=False)
            self._prefix_tokens -= len(old)

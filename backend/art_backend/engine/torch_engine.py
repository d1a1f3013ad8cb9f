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
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import llguidance
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from art_backend.chat_format import ChatFormatter
from art_backend.config import PREFIX_CACHE_BYTES, PREFIX_CACHE_IDLE_SECONDS
from art_backend.engine.base import (GenerationRequest, LentModel, SequenceDelta, TokenLogprob, end_of_turn_ids,
                                     is_base_model)
from art_backend.engine.detokenizer import IncrementalText
from art_backend.engine.host_memory import return_freed_memory_to_os, reusing_freed_memory
from art_backend.engine.llama import LeanLlama, LoraWeights
from art_backend.engine.peft_adapters import ServedAdapters, Unread, check_servable
from art_backend.engine.prefix_cache import PrefixCache
from art_backend.engine.sampling import Penalties, RowSampling, sample
from art_backend.engine.scheduler import PrefixHit, Scheduler
from art_backend.engine.sequence import ActiveSequence, QueuedRequest
from art_backend.errors import ContextLengthError, InvalidSamplingError, ModelNotServedError
from art_backend.grammar import Constrainer, GrammarError
from art_integrations.training import LoraConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_CONTEXT = 8192


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
        self._jobs: deque[tuple[Callable[[], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        # All of the engine's torch work runs on this one thread, loading included: GNU OpenMP
        # keeps a thread team per calling thread, and with a second team alive on the machine's
        # cores its threads stop spinning between parallel regions, so each of a decode step's
        # ~200 small parallel kernels waits for its threads to wake (a 16-row step ~40% slower).
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        load = functools.partial(self._load, model_dir, max_model_len, threads, dtype, cpu_kernels,
                                 prefix_cache_bytes, prefix_cache_idle_seconds)
        self._worker = threading.Thread(target=self._run, args=(load, loaded), name="art-torch-engine", daemon=True)
        self._worker.start()
        loaded.result()  # raises what loading raised

    def _load(self, model_dir: Path, max_model_len: int | None, threads: int | None, dtype: str,
              cpu_kernels: bool, prefix_cache_bytes: int, prefix_cache_idle_seconds: float) -> None:
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
        merge = self.lean.weights_dtype == torch.float32 and not self.lean.grouped_matrices
        self.adapters = ServedAdapters(self.lean, self.device, merge)
        # the kernels' allocator that reuses freed blocks within a step or a prefill, where allowed
        self._step_memory = self.lean.kernels if self._tune_process_memory else None
        self._lent = LentModel(self.model, self._step_memory)
        self._cache = self.lean.new_cache()
        prefixes = PrefixCache(prefix_cache_bytes, prefix_cache_idle_seconds, self._cache.bytes_per_token)
        self.scheduler = Scheduler(self.max_batch_size, prefixes, self._wake)
        logger.info("Loaded %s in %.1f s on %s (serving weights %s, %s)", model_dir, time.perf_counter() - started,
                    self.device, self.lean.weights_layout(), "fused decode kernels" if self.lean.kernels is not None
                    else "eager decode ops")

    # ----- the Engine interface ---------------------------------------------------------

    def served_models(self) -> list[str]:
        return [self.base_model_name, *self.base_model_aliases, *self.adapters.names()]

    async def load_adapter(self, name: str, path: Path | None, preload: bool = True) -> None:
        await self._on_worker(lambda: self.adapters.serve(name, path, preload))

    async def remove_adapter(self, name: str) -> None:
        await self._on_worker(lambda: self.adapters.remove(name))

    def check_lora(self, lora: LoraConfig) -> None:
        check_servable(lora)

    def chat_formatter(self, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatFormatter:
        return ChatFormatter(self.tokenizer, tool_call_parser, reasoning_parser)

    def lent_model(self) -> LentModel:
        """The trainer trains this engine's own Hugging Face model (the serving forward keeps copies
        of the frozen weights), with the kernels' step allocator where the process allows it."""
        return self._lent

    async def run_training(self, step: Callable[[], dict[str, float]]) -> dict[str, float]:
        """On the worker thread, between decode steps: the trainer's torch work shares the engine's
        OpenMP team and allocator arena; requests wait meanwhile."""
        asked = time.perf_counter()

        def timed() -> dict[str, float]:
            waited = time.perf_counter() - asked
            return {**step(), "wait_seconds": waited}

        return await self._on_worker(timed)

    async def _on_worker(self, job: Callable[[], T]) -> T:
        """Run `job` on the worker thread between decode steps: decoding pauses meanwhile (queued
        requests just wait), and the job's memory comes from the same allocator arena as
        decoding's rather than from a fresh thread's, which would keep it all reserved."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
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
        if isinstance(adapter, Unread):
            adapter = await self._on_worker(lambda: self.adapters.read_on_first_use(request.model))
        total = len(request.prompt_ids)
        if request.params.grammar is not None:
            self.constrainer.check(request.params.grammar)
        if total + request.params.max_tokens > self.max_model_len:
            raise ContextLengthError.over(self.max_model_len, total, request.params.max_tokens)
        state = QueuedRequest(request, adapter, asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            self.scheduler.waiting.append(state)
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

    def resolve_adapter(self, model: str | None) -> LoraWeights | Unread | None:
        """The adapter a request for `model` runs with (None: the base model; `Unread`: not read yet)."""
        if is_base_model(self, model):
            return None
        if model in self.adapters:
            return self.adapters.resolve(model)
        raise ModelNotServedError.unknown(model, self.served_models())

    # ----- the worker thread ------------------------------------------------------------

    def _run(self, load: Callable[[], None], loaded: concurrent.futures.Future[None]) -> None:
        try:
            load()
        except BaseException as error:  # the constructor re-raises it
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        scheduler = self.scheduler
        while True:
            with self._wake:
                while not self._closed and not scheduler.waiting and not scheduler.active and not self._jobs:
                    if not self._wake.wait(scheduler.prefixes.idle_wait()):
                        scheduler.prefixes.forget()
                if self._closed:
                    break
            self._run_jobs()
            try:
                # a prefill's layers free and remake the same sizes (a decode step's tensors are
                # too small to gain: measured, the main job ran no faster)
                if scheduler.waiting:
                    with reusing_freed_memory(self._step_memory):
                        self._admit()
                if scheduler.active:
                    self._decode_step()
                if not scheduler.active:
                    self._cache.release()
            except Exception as error:  # a failed step fails its requests, never the server
                logger.exception("Engine step failed; failing the %d active sequences", len(scheduler.active))
                self._fail_active(error)
        for seq in scheduler.active:
            self._send(seq.request, RuntimeError("The engine was closed."))

    def _run_jobs(self) -> None:
        while self._jobs:
            job, future, loop = self._jobs.popleft()
            try:
                result = job()
            except Exception as error:  # the job's caller gets the error; the engine goes on
                loop.call_soon_threadsafe(future.set_exception, error)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

    def _send(self, request: QueuedRequest, item: list[SequenceDelta] | BaseException) -> None:
        try:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is left to read this
            logger.warning("Dropping output of a request whose event loop has closed")
            request.aborted = True

    def _fail_active(self, error: Exception) -> None:
        failed = {id(s.request): s.request for s in self.scheduler.active}
        self.scheduler.active.clear()
        for request in failed.values():
            self._send(request, error)

    def _admit(self) -> None:
        """Prefill waiting requests, as many together as fit, until none is left."""
        while self.scheduler.waiting:
            batch = self.scheduler.next_prefill_batch()
            if not batch:
                return
            try:
                self._prefill(batch)
            except Exception as error:
                logger.exception("Prefill failed")
                failed = {id(request) for request, _ in batch}
                self.scheduler.active = [s for s in self.scheduler.active if id(s.request) not in failed]
                for request, _ in batch:
                    self._send(request, error)

    def _prefill(self, batch: list[tuple[QueuedRequest, PrefixHit]]) -> None:
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
        active = self.scheduler.active
        first_slot = len(active)
        slots, starts, prompts = [], [], []
        slot = first_slot
        for request, hit in batch:
            prompt = request.spec.prompt_ids
            self._cache.reserve(slot + request.spec.n, len(prompt) + 1)
            slots.append(slot)
            starts.append(self.scheduler.copy_prefix(hit, self._cache, slot))
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
            for index, (rows, text, matcher, penalties) in enumerate(states[id(request)]):
                if index:
                    self._cache.move(slot, slot + index, len(prompt))
                active.append(ActiveSequence(request, index, list(prompt), [], rows, text, matcher, penalties))
        row_of_request = [row for row, (request, _) in enumerate(batch) for _ in range(request.spec.n)]
        if self.lean.kernels is not None:
            for seq in active[first_slot:]:
                self.scheduler.find_leader(seq)
        self._accept(active[first_slot:], logits[row_of_request])

    def _sampling_state(self, request: QueuedRequest, index: int
                        ) -> tuple[RowSampling, IncrementalText, llguidance.LLMatcher | None, Penalties | None]:
        params = request.spec.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        penalties = Penalties.for_prompt(request.spec.prompt_ids, params.frequency_penalty, params.presence_penalty,
                                         params.repetition_penalty, params.logit_bias)
        rows = RowSampling(params.temperature, params.top_p, params.top_logprobs, generator, params.top_k, params.min_p,
                           penalized=penalties is not None)
        text = IncrementalText(self.tokenizer, params.stop, params.skip_special_tokens)
        matcher = self.constrainer.matcher(params.grammar) if params.grammar is not None else None
        return rows, text, matcher, penalties

    def _shared_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where each row of a decode step reads its prompt's start (only the fused kernels can)."""
        return None if self.lean.kernels is None else self.scheduler.shared_kv(self.device)

    def _lora(self, adapters: list[LoraWeights | None]) -> list[LoraWeights | None] | None:
        return adapters if any(a is not None for a in adapters) else None

    def _decode_step(self) -> None:
        active = self.scheduler.active
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

    def _accept(self, seqs: list[ActiveSequence], logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs`, update their text, send deltas, retire the finished."""
        penalized = [row for row, seq in enumerate(seqs) if seq.penalties is not None]
        policy_logits = logits.clone() if penalized else None  # the policy's own, which the logprobs report
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
        allowed = self.constrainer.allowed_tokens([s.matcher for s in seqs], logits.shape[-1],
                                                  self.tokenizer.eos_token_id, self.device)
        sampled = sample(logits, [s.rows for s in seqs], allowed, self.lean.kernels, policy_logits)
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
            seq.append(TokenLogprob(token, logprob, top), self.stop_ids, self.max_model_len)
            if seq.request.aborted:
                seq.finish_reason = "abort"
            delta = seq.delta()
            if delta is not None:
                by_request.setdefault(id(seq.request), []).append(delta)
        for seq in seqs:
            if seq.request.aborted:
                continue
            deltas = by_request.pop(id(seq.request), None)
            if deltas:
                self._send(seq.request, deltas)
        self.scheduler.retire(self._cache)

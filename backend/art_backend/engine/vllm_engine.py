"""The vLLM engine: the `Engine` interface served by vLLM (paged KV cache, prefix caching,
LoRA adapters, tensor parallelism; CUDA graphs on a GPU), trained by the training service.

What reaches vLLM is what reaches the torch engine: prompt token ids rendered by our chat
formatter (so the ids we return are exactly those the model saw), the same llguidance grammars
for forced tool calls and JSON (vLLM's structured outputs, guidance backend), and the same stop
tokens. Penalties, logit bias and the top-k, min-p and top-p cuts are vLLM's own, which the
torch engine follows (`sampling.py`), and logprobs are the policy's own at the request's
temperature, before penalties, bias, the cuts and a grammar's mask, as the torch engine reports
them and the trainer recomputes them (`vllm_policy_logprobs.py`: vLLM's own modes measure other
distributions, 0.0 for a token a grammar forces). On CPU, adapters are applied with one
matmul per adapter in the batch (`vllm_cpu_lora.py`: vLLM's own CPU ops copy each token's matrix).

Every checkpoint is a `LoRARequest` read from its directory. A training step pauses
scheduling (requests in flight freeze, new ones queue; on a GPU vLLM also sleeps, level 1, so
the trainer has the memory), trains on a separate copy of the base weights (peft, or Unsloth
on a GPU when it imports), and resumes; the new checkpoint is loaded before the step returns.

vLLM's `AsyncLLM` belongs to the event loop it was created on, so it lives on a loop of its own
in a thread, and calls from any other loop (the HTTP server's, a test's, `LocalBackend`'s)
are bridged to it, as the torch engine bridges to its worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoTokenizer, GenerationConfig

from art_backend.chat_format import ChatFormatter
from art_backend.engine.base import (LOWEST_LOGPROB, GenerationRequest, LentModel, SequenceDelta, TokenLogprob, end_of_turn_ids,
                                     is_base_model)
from art_backend.engine.host_memory import return_freed_memory_to_os
from art_backend.engine.vllm_args import LORA_RANKS, import_vllm, vllm_engine_args
from art_backend.errors import ContextLengthError, DamagedCheckpointError, InvalidSamplingError, ModelNotServedError
from art_backend.grammar import Constrainer, GrammarError
from art_backend.tool_formats.vllm_parsers import use_vllm_parsers
from art_integrations.training import LoraConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# what vLLM serves LoRA on in Llama/Qwen models (it fuses q/k/v and gate/up itself)
_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _refused(error: Exception) -> InvalidSamplingError:
    """A request vLLM refused (its ValueError or VLLMClientError) as the client's error, with the way forward
    where vLLM's own message gives none."""
    hint = " (vLLM draws several samples only at a temperature above 0)" if "greedy" in str(error) else ""
    return InvalidSamplingError(f"{error}{hint}")


class VLLMEngine:
    """Serves a local Hugging Face model directory through vLLM (see `Engine` for the interface)."""

    def __init__(self, model_dir: Path, served_model_name: str | None = None, aliases: Sequence[str] = (),
                 max_model_len: int | None = None, dtype: str = "float32", max_batch_size: int | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                 max_loras: int = 4, max_cpu_loras: int | None = None, max_lora_rank: int = 16,
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 engine_args: Mapping[str, Any] | None = None, tune_process_memory: bool = False,
                 load_trainer_first: Callable[[VLLMEngine], object] | None = None) -> None:
        """`dtype`: the weights' precision on CPU (float32 by default, the trainer's, so sampled
        logprobs match its recomputation); on a GPU always bfloat16. `engine_args`: any further
        `vllm.AsyncEngineArgs` fields, passed through (they win over ours). `tune_process_memory`:
        freed host memory goes back to the system after each training step (host_memory.py), in a
        process the backend owns or where its user asked. `load_trainer_first`: on a GPU, called on
        the training thread before vLLM sizes its share of the GPU's memory (the training service's
        trainer, whose copy of the weights must fit beside vLLM's)."""
        if tune_process_memory:
            return_freed_memory_to_os()
        vllm = import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.async_llm import AsyncLLM

        if max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank={max_lora_rank}: vLLM takes one of {', '.join(map(str, LORA_RANKS))}.")
        self._vllm = vllm
        # prompts go in as vLLM's engine input, already rendered: a plain {"prompt_token_ids": ...}
        # is deprecated there (rendered again by vLLM, with a warning)
        self._tokens_input = tokens_input
        self.model_dir = Path(model_dir)
        self.on_gpu = torch.cuda.is_available()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.base_model_name = served_model_name or self.model_dir.name
        self.base_model_aliases = tuple(dict.fromkeys(a for a in aliases if a != self.base_model_name))
        args = vllm_engine_args(
            self.model_dir, self.base_model_name, max_model_len=max_model_len, dtype=dtype,
            max_batch_size=max_batch_size, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
            max_lora_rank=max_lora_rank, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size)
        self.max_model_len = args["max_model_len"]
        self.max_lora_rank = max_lora_rank
        self.constrainer = Constrainer(self.tokenizer)
        try:
            generation_eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's EOS is the model's
            generation_eos = None
        self.stop_ids = sorted(end_of_turn_ids(self.tokenizer, generation_eos))
        self._adapters: dict[str, Any] = {}  # served name -> LoRARequest (None: the base model under another name)
        self._next_lora_id = 1
        # The trainer's torch work stays on this one thread (GNU OpenMP keeps a thread team per
        # calling thread; see torch_engine.py).
        self._training = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-vllm-trainer")
        self._train_lock: asyncio.Lock | None = None  # made on the engine's loop

        if self.on_gpu:
            # The trainer's copy of the weights stays on the GPU beside vLLM's (vLLM sleeps during a
            # step, but wakes to its whole share): it is loaded first, and vLLM gets what is left.
            if load_trainer_first is not None:
                self._training.submit(load_trainer_first, self).result()
            if gpu_memory_utilization is None:
                free, total = torch.cuda.mem_get_info()
                args["gpu_memory_utilization"] = round(min(0.9, free / total - 0.05), 2)
        extra = dict(engine_args or {})
        unknown = sorted(set(extra) - set(AsyncEngineArgs.__dataclass_fields__))
        if unknown:
            raise ValueError(f"Not vLLM engine arguments: {', '.join(unknown)} (see vllm.AsyncEngineArgs).")
        if "worker_extension_cls" in extra:
            raise ValueError("worker_extension_cls is the backend's own (it makes logprobs under a grammar the "
                             "policy's, and on CPU puts in its LoRA ops: engine/vllm_worker.py): leave it out of "
                             "the engine arguments.")
        args.update(extra)
        self.engine_args = AsyncEngineArgs(**args)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="art-vllm-engine", daemon=True)
        self._thread.start()
        started = time.perf_counter()
        try:
            self._llm = asyncio.run_coroutine_threadsafe(self._start(AsyncLLM), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        logger.info("vLLM %s serving %s in %.1f s on %s (%s, context %d, LoRA up to rank %d, %d per batch%s)",
                    vllm.__version__, self.model_dir, time.perf_counter() - started, "GPU" if self.on_gpu else "CPU",
                    args["dtype"], self.max_model_len, max_lora_rank, max_loras,
                    f", {args['gpu_memory_utilization']:.0%} of GPU memory" if self.on_gpu else "")

    async def _start(self, async_llm: Any) -> Any:
        from vllm.usage.usage_lib import UsageContext

        self._train_lock = asyncio.Lock()
        # As vLLM's own OpenAI server starts it: the batch limits vLLM picks by hardware are the
        # server's (on an H100: 1024 sequences and 8192 tokens per step; the engine context's
        # fallback is 128 and 2048, which capped a GPU's rollouts at 128 in flight)
        llm = async_llm.from_engine_args(self.engine_args, usage_context=UsageContext.OPENAI_API_SERVER)
        if not all(await llm.collective_rpc("report_policy_logprobs")):
            logger.warning("vLLM %s: logprobs under a grammar are vLLM's own, taken after the mask (see the "
                           "worker's log)", self._vllm.__version__)
        if not self.on_gpu and not all(await llm.collective_rpc("group_cpu_lora_ops")):
            logger.warning("vLLM %s: its CPU LoRA ops are not the ones art_backend knows, so they stay vLLM's own "
                           "(several times slower with an adapter, and a base-model request batched beside four "
                           "adapters is served with the last: engine/vllm_cpu_lora.py)", self._vllm.__version__)
        return llm

    # ----- bridging to the engine's loop --------------------------------------------------

    def _on_engine_loop(self, coroutine: Coroutine[Any, Any, T]) -> Awaitable[T]:
        """Run `coroutine` on the engine's loop; await the result from the caller's loop."""
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    # ----- the Engine interface ---------------------------------------------------------

    def served_models(self) -> list[str]:
        return [self.base_model_name, *self.base_model_aliases, *self._adapters]

    def chat_formatter(self, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatFormatter:
        formatter = ChatFormatter(self.tokenizer, tool_call_parser, reasoning_parser)
        use_vllm_parsers(formatter, self.tokenizer)
        return formatter

    def check_lora(self, lora: LoraConfig) -> None:
        if lora.rank > self.max_lora_rank:
            raise ValueError(
                f"LoRA rank {lora.rank} is above the vLLM engine's --max-lora-rank {self.max_lora_rank}: restart "
                f"the backend with --max-lora-rank {min(r for r in LORA_RANKS if r >= lora.rank)} (or "
                "ART_BACKEND_MAX_LORA_RANK), or train a smaller rank.")
        unknown = sorted(set(lora.target_modules) - set(_LORA_TARGETS))
        if unknown:
            raise ValueError(f"LoRA on {', '.join(unknown)} is not served by the vLLM engine; target modules: "
                             f"{', '.join(_LORA_TARGETS)}.")

    async def load_adapter(self, name: str, path: Path | None, preload: bool = True) -> None:
        """Serve the adapter at `path` (None: the base model) as `name`. One checkpoint served under
        two names is one vLLM adapter (one id: its requests batch and share cached prefixes). It is
        loaded now, so a damaged checkpoint fails here rather than at its first request; with
        `preload=False` vLLM reads it when first asked for."""
        if path is None:
            await self._replace(name, None)
            return
        path = Path(path).resolve()
        request = next((r for r in self._adapters.values() if r is not None and r.lora_path == str(path)), None)
        if request is None:
            try:
                rank = json.loads((path / "adapter_config.json").read_text())["r"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise DamagedCheckpointError(f"The adapter at {path} does not load: {error!r}") from error
            if rank > self.max_lora_rank:
                raise ValueError(f"{path}: LoRA rank {rank} is above --max-lora-rank {self.max_lora_rank}.")
            request = self._vllm.lora.request.LoRARequest(name, self._next_lora_id, str(path))
            self._next_lora_id += 1
        if preload:  # vLLM keeps an adapter it has loaded already as it is
            try:
                await self._on_engine_loop(self._llm.add_lora(request))
            except Exception as error:  # noqa: BLE001 - vLLM's own errors for a file it cannot read
                raise DamagedCheckpointError(f"vLLM cannot load the adapter at {path}: {type(error).__name__}: "
                                             f"{error}") from error
        await self._replace(name, request)

    async def _replace(self, name: str, request: Any) -> None:
        previous = self._adapters.get(name)
        self._adapters[name] = request
        await self._unload_if_unused(previous)

    async def _unload_if_unused(self, request: Any) -> None:
        if request is not None and all(r is not request for r in self._adapters.values()):
            await self._on_engine_loop(self._llm.remove_lora(request.lora_int_id))

    async def remove_adapter(self, name: str) -> None:
        await self._unload_if_unused(self._adapters.pop(name, None))

    def resolve_adapter(self, model: str | None) -> Any:
        """The LoRARequest a request for `model` runs with (None: the base model)."""
        if is_base_model(self, model):
            return None
        if model in self._adapters:
            return self._adapters[model]
        raise ModelNotServedError.unknown(model, self.served_models())

    async def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceDelta]:
        lora = self.resolve_adapter(request.model)
        prompt_tokens, params = len(request.prompt_ids), request.params
        if params.grammar is not None:
            self.constrainer.check(params.grammar)
        if prompt_tokens + params.max_tokens > self.max_model_len:
            raise ContextLengthError.over(self.max_model_len, prompt_tokens, params.max_tokens)
        sampling = self._sampling_params(request)
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[list[SequenceDelta] | BaseException | None] = asyncio.Queue()

        def send(item: list[SequenceDelta] | BaseException | None) -> None:
            try:
                caller.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is left to read this
                logger.warning("Dropping output of a request whose event loop has closed")

        async def pump() -> None:
            try:
                async for output in self._llm.generate(self._tokens_input(request.prompt_ids), sampling,
                                                       uuid.uuid4().hex, lora_request=lora):
                    send([self._delta(o, params.top_logprobs, params.grammar is not None) for o in output.outputs])
            except asyncio.CancelledError:  # the caller went away: vLLM aborts the request
                raise
            except (ValueError, self._vllm.exceptions.VLLMClientError) as error:  # as its own server, a 400
                send(_refused(error))
            except BaseException as error:  # noqa: BLE001 - handed to the caller, who raises it
                send(error)
            else:
                send(None)

        running = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    yield delta
        finally:
            running.cancel()

    def _sampling_params(self, request: GenerationRequest) -> Any:
        vllm, params = self._vllm, request.params
        grammar = vllm.sampling_params.StructuredOutputsParams(grammar=params.grammar) if params.grammar else None
        try:
            return vllm.SamplingParams(
                n=request.n, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, min_p=params.min_p, frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty, repetition_penalty=params.repetition_penalty,
                logit_bias=dict(params.logit_bias) or None,
                seed=params.seed, stop=list(params.stop) or None, ignore_eos=params.ignore_eos,
                skip_special_tokens=params.skip_special_tokens,
                # the torch engine's end-of-turn tokens (its EOS, the generation config's, <|im_end|>)
                stop_token_ids=None if params.ignore_eos else self.stop_ids,
                logprobs=params.top_logprobs if params.logprobs or params.top_logprobs else None,
                structured_outputs=grammar,
                output_kind=vllm.sampling_params.RequestOutputKind.DELTA)
        except (ValueError, vllm.exceptions.VLLMClientError) as error:  # its own server answers these with a 400
            raise _refused(error) from error

    @staticmethod
    def _delta(output: Any, top_logprobs: int, grammar: bool) -> SequenceDelta:
        token_ids = list(output.token_ids)
        logprobs = [VLLMEngine._token_logprob(token, position, top_logprobs)
                    for token, position in zip(token_ids, output.logprobs or ())]
        finish = output.finish_reason
        if finish == "error" and grammar:  # what vLLM says when its structured output gives up on a grammar
            raise GrammarError("The requested structure cannot be enforced: vLLM's structured output could not "
                               "follow it (a schema with no finite instance, say)")
        if finish not in (None, "stop", "length", "abort"):
            raise RuntimeError(f"vLLM ended a sequence with {finish!r}")
        return SequenceDelta(output.index, token_ids, logprobs, output.text, finish)

    @staticmethod
    def _token_logprob(token: int, position: Mapping[int, Any], top_logprobs: int) -> TokenLogprob:
        top = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= top_logprobs),
                     key=lambda item: item[1].rank)
        return TokenLogprob(token, max(position[token].logprob, LOWEST_LOGPROB),
                            [(t, max(lp.logprob, LOWEST_LOGPROB)) for t, lp in top])

    # ----- training ---------------------------------------------------------------------

    def lent_model(self) -> LentModel | None:
        return None  # vLLM's weights are its workers'; the trainer loads a copy

    async def run_training(self, step: Callable[[], dict[str, float]]) -> dict[str, float]:
        def run() -> dict[str, float]:
            try:
                return step()
            finally:
                if self.on_gpu:
                    torch.cuda.empty_cache()  # the step's activations go back before vLLM wakes

        return await self._on_engine_loop(self._paused(run))

    async def _paused(self, step: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run `step` on the trainer thread while vLLM schedules nothing: requests in flight
        freeze and new ones queue (none fails); on a GPU vLLM also sleeps, handing the trainer
        the memory of its KV cache and weights."""
        assert self._train_lock is not None
        asked = time.perf_counter()
        async with self._train_lock:
            waited = time.perf_counter() - asked
            paused = time.perf_counter()
            if self.on_gpu:
                await self._llm.sleep(level=1, mode="keep")
            else:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
            pause_seconds = time.perf_counter() - paused
            try:
                metrics = await asyncio.get_running_loop().run_in_executor(self._training, step)
            finally:
                resumed = time.perf_counter()
                if self.on_gpu:
                    await self._llm.wake_up()
                else:
                    await self._llm.resume_generation()
                resume_seconds = time.perf_counter() - resumed
        return {**metrics, "wait_seconds": waited, "pause_seconds": pause_seconds, "resume_seconds": resume_seconds}

    async def close(self) -> None:
        if self._thread.is_alive():
            await self._on_engine_loop(self._shutdown())
            self._stop_loop()
        await asyncio.to_thread(self._training.shutdown)

    async def _shutdown(self) -> None:
        self._llm.shutdown()
        self._llm = None  # its finalizer would shut it down again at interpreter exit

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


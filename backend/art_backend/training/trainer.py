"""One GRPO step (or SFT step, sft.py) on a LoRA adapter of a transformers model (peft), CPU or one GPU.

One `LoraTrainer` holds every trained model's adapter on the shared base model; each model
has its own named adapter and AdamW state, kept in memory between steps and in its
checkpoint directory (`adapter_model.safetensors`, `adapter_config.json`, `optimizer.pt`)
so a restarted backend continues exactly where it stopped. The training service makes it
(`OneTrainer`): on the torch engine's own serving model, or beside vLLM on a copy
(`base_model.py`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from art_backend.engine.host_memory import reusing_freed_memory
from art_backend.errors import DamagedCheckpointError
from art_backend.kill_points import kill_point
from art_backend.training.base_model import FirstAdapter, peft_first_adapter
from art_backend.training.loss import LossConfig, LossTerms, policy_loss, sequence_log_ratio, token_log_ratio
from art_backend.training.packing import PackedBatch, pack, padded_batches
from art_backend.training.sft import SFT_LOSS, sft_loss
from art_backend.training.tokenize import TrainSequence
from art_backend.training.tree_attention import tree_attention_for, tree_layout
from art_integrations.training import LoraConfig, TrainConfig


logger = logging.getLogger(__name__)

# Trained tokens whose logits exist at once in a step (see `LoraTrainer._loss_backward_saving_logit_memory`):
# SmolLM2's vocabulary makes that 48 MiB per float32 copy, against 245 MiB for the main job's whole step.
LOGIT_CHUNK_TOKENS = 256

def output_head(model: PreTrainedModel) -> torch.nn.Module:
    """The model's output projection, where its logits are exactly that projection of its decoder's
    last hidden states, so a step can make logits a chunk of tokens at a time; else the identity, and
    the step takes the whole model's logits. Checked once on a few tokens, since some families scale,
    soft-cap or otherwise post-process their logits (Gemma 2, Cohere, Granite)."""
    head = model.get_output_embeddings()
    if head is None:
        logger.info("Trainer: the whole model's logits per step (it names no output head)")
        return torch.nn.Identity()
    try:
        with torch.no_grad():
            ids = torch.tensor([[1, 2, 3, 4]], device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits.float()
            projected = head(model.get_decoder()(input_ids=ids).last_hidden_state).float()
    except Exception as error:  # noqa: BLE001 - any model whose parts do not run apart keeps the whole forward
        logger.info("Trainer: the whole model's logits per step (its decoder and head do not run apart: %r)", error)
        return torch.nn.Identity()
    if projected.shape != logits.shape or not torch.allclose(projected, logits, rtol=1e-3, atol=1e-3):
        logger.info("Trainer: the whole model's logits per step (they are not its head's projection of its decoder)")
        return torch.nn.Identity()
    return head


def _init_seed(model_name: str) -> int:
    """The seed of a new adapter's random A matrices: from the model's name alone, so a run starts
    from the same adapter whatever else its process drew before and whichever engine serves it."""
    return int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:8], "little") >> 1


def _adapter_key(model_name: str) -> str:
    # peft adapter names become module attribute names: keep them identifier-like
    return "m_" + re.sub(r"\W", "_", model_name)


def loss_config(config: TrainConfig) -> LossConfig:
    epsilon = config.epsilon if config.epsilon is not None else (1.0 if config.loss == "cispo" else 0.2)
    epsilon_high = config.epsilon_high if config.epsilon_high is not None else (
        4.0 if config.loss == "cispo" else epsilon)
    return LossConfig(config.loss, epsilon, epsilon_high, config.beta, config.importance_sampling_level)


class AdapterUpdate:
    """The optimizer step of an adapter being trained (`LoraTrainer.updating`)."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        self.params = params
        self.optimizer = optimizer

    def step(self, learning_rate: float, max_grad_norm: float) -> float:
        """The accumulated gradient's norm clipped to `max_grad_norm`, one AdamW step at
        `learning_rate`, the gradients cleared; the norm before clipping."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)


class LoraTrainer:
    def __init__(self, model: PreTrainedModel, first_adapter: FirstAdapter = peft_first_adapter,
                 packing: bool = True, step_memory: Any | None = None) -> None:
        """`packing`: run each step's sequences as prefix trees (packing.py), which takes a model
        whose attention goes through transformers' attention interface: on CPU it attends per
        tree segment (tree_attention.py), elsewhere with the row's 4D mask as given (SDPA and
        eager attention apply it).
        `step_memory` (`load_cpu_kernels()`, on CPU, in a process whose allocator may be swapped): a
        step reuses the host memory it frees (host_memory.py)."""
        self.step_memory = step_memory
        self.base = model
        self.first_adapter = first_adapter
        self.packing = packing
        self.peft: PeftModel | None = None
        self.keys: dict[str, str] = {}  # trained model name -> its peft adapter's name
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.references: dict[str, Path] = {}  # a KL reference's peft adapter -> the checkpoint loaded into it
        self.device = next(model.parameters()).device
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.head = output_head(model)

    def _adapter(self, model_name: str, lora: LoraConfig, resume_from: Path | None) -> tuple[str, list[torch.nn.Parameter]]:
        key = self.keys.get(model_name)
        if key is None:
            config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                    lora_dropout=0.0, task_type="CAUSAL_LM")
            key = _adapter_key(model_name)
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(_init_seed(model_name))
                if self.peft is None:
                    self.peft, key = self.first_adapter(self.base, config, key)
                else:
                    self.peft.add_adapter(key, config)
            self.keys[model_name] = key
        assert self.peft is not None
        self.peft.set_adapter(key)
        params = [p for n, p in self.peft.named_parameters() if f".{key}." in n]
        for p in params:
            p.requires_grad_(True)
        if key not in self.optimizers:
            optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
            if resume_from is not None:  # all of it, or the step fails: never a fresh adapter or a reset optimizer
                try:
                    state = torch.load(resume_from / "optimizer.pt", map_location=self.device, weights_only=True)
                    self._load_adapter_weights(key, resume_from)
                    optimizer.load_state_dict(state)
                except Exception as error:  # noqa: BLE001 - every way a checkpoint fails to load is damage
                    raise DamagedCheckpointError(f"Cannot continue training from {resume_from}: "
                                                 f"{type(error).__name__}: {error}") from error
            self.optimizers[key] = optimizer
        return key, params

    @contextlib.contextmanager
    def updating(self, model_name: str, lora: LoraConfig, resume_from: Path | None, save_to: Path,
                 checkpoint_activations: bool) -> Iterator[AdapterUpdate]:
        """`model_name`'s adapter made active and trainable (continuing from `resume_from` if it is
        not in memory), in train mode; on leaving without an error, its adapter and optimizer state
        written to `save_to` (a step that raised writes nothing)."""
        key, params = self._adapter(model_name, lora, resume_from)
        assert self.peft is not None
        optimizer = self.optimizers[key]
        optimizer.zero_grad(set_to_none=True)  # a step that failed halfway may have left gradients
        with reusing_freed_memory(self.step_memory):
            self.peft.train()
            self._checkpoint_activations(checkpoint_activations)
            try:
                yield AdapterUpdate(params, optimizer)
            finally:
                optimizer.zero_grad(set_to_none=True)
                self.peft.eval()
        self._save(key, optimizer, save_to)

    def _checkpoint_activations(self, on: bool) -> None:
        """Turn transformers' gradient checkpointing on or off, where it is not so already (Unsloth's
        model comes with its own on, which stays)."""
        if on == any(getattr(module, "gradient_checkpointing", False) for module in self.base.modules()):
            return
        # transformers 5 renamed these `activation_checkpointing_*`; the old names warn that they are deprecated
        if on:
            enable = getattr(self.base, "activation_checkpointing_enable", self.base.gradient_checkpointing_enable)
            enable({"use_reentrant": False})
        else:
            getattr(self.base, "activation_checkpointing_disable", self.base.gradient_checkpointing_disable)()

    def sft_step(self, model_name: str, batches: list[list[TrainSequence]], learning_rates: list[float],
                 config: TrainConfig, lora: LoraConfig, resume_from: Path | None, save_to: Path) -> dict[str, float]:
        """An SFT step (sft.py): one optimizer step per batch, batch b at `learning_rates[b]`, then
        one checkpoint. `config` gives the rest (clipping, micro-batches, checkpointing)."""
        started = time.perf_counter()
        tokens = [sum(sum(s.assistant_mask) for s in batch) for batch in batches]
        losses, norms = [], []
        with self.updating(model_name, lora, resume_from, save_to, config.gradient_checkpointing) as update:
            for batch, rate in zip(batches, learning_rates):
                losses.append(self.accumulate_gradients(batch, config, SFT_LOSS)["loss"])
                norms.append(update.step(rate, config.max_grad_norm))
        # each batch's loss is its tokens' mean, before its update: the step's is their token-weighted mean
        return {"loss": sum(l * n for l, n in zip(losses, tokens)) / max(sum(tokens), 1),
                "loss/first_batch": losses[0], "loss/last_batch": losses[-1],
                "grad_norm": sum(norms) / len(norms), "train_seconds": time.perf_counter() - started}

    def accumulate_gradients(self, sequences: list[TrainSequence], config: TrainConfig,
                             losses: LossConfig | None = None, kl_reference: Path | None = None) -> dict[str, float]:
        """The step's loss over `sequences` (each of its parts summed) and its gradients on the
        active adapter, forward by forward: prefix-tree rows with packing, else padded rows.
        `losses`: the loss to take (SFT's), if not the one `config` names; `kl_reference`: the
        checkpoint the KL term is measured against (None: the base model)."""
        assert self.peft is not None
        losses = losses or loss_config(config)
        reference = self._reference_policy(kl_reference)
        # each token's weight becomes its share of the step's loss, here once for every micro-batch
        total_weight = sum(s.weight * sum(s.assistant_mask) for s in sequences)
        sequences = [dataclasses.replace(s, weight=s.weight / total_weight) for s in sequences]
        sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clipped_fraction": 0.0, "entropy": 0.0}
        batches = (pack(sequences, config.micro_batch_tokens) if self.packing
                   else padded_batches(sequences, len, config.micro_batch_tokens))
        for batch in batches:
            if isinstance(batch, PackedBatch):
                terms, entropy = self._packed_backward(batch, config, losses, reference)
            else:
                terms, entropy = self._backward(batch, config, losses, reference)
            sums["loss"] += float(terms.loss.detach())
            sums["policy_loss"] += float(terms.policy_loss)
            sums["kl"] += float(terms.kl)
            sums["clipped_fraction"] += float(terms.clipped_fraction)
            sums["entropy"] += entropy
        return sums

    def _load_adapter_weights(self, key: str, checkpoint: Path) -> None:
        """`checkpoint`'s adapter weights into the peft adapter `key`."""
        assert self.peft is not None
        weights = load_file(str(checkpoint / "adapter_model.safetensors"), device=str(self.device))
        set_peft_model_state_dict(self.peft, weights, adapter_name=key)

    def _reference_policy(self, checkpoint: Path | None) -> Callable[[], AbstractContextManager[Any]]:
        """What the KL term's reference logprobs are taken under: the base model (the adapter off),
        or `checkpoint`'s adapter, loaded into a frozen peft adapter of its own (once per checkpoint)."""
        assert self.peft is not None
        if checkpoint is None:
            return self.peft.disable_adapter
        trained = self.peft.active_adapter
        key = f"{trained}_reference"
        if self.references.get(key) != checkpoint:
            if key not in self.peft.peft_config:
                self.peft.add_adapter(key, copy.deepcopy(self.peft.peft_config[trained]))  # the same LoRA shape
            try:
                self._load_adapter_weights(key, checkpoint)
            except Exception as error:  # noqa: BLE001 - every way a checkpoint fails to load is damage
                self.references.pop(key, None)
                raise DamagedCheckpointError(f"Cannot read the KL reference {checkpoint}: "
                                             f"{type(error).__name__}: {error}") from error
            finally:
                self.peft.set_adapter(trained)  # adding an adapter leaves the trained one active; made sure
            self.references[key] = checkpoint

        @contextlib.contextmanager
        def reference_active() -> Iterator[None]:
            self.peft.set_adapter(key, inference_mode=True)
            try:
                yield
            finally:
                self.peft.set_adapter(trained)  # trainable again

        return reference_active

    def _backward(self, batch: list[TrainSequence], config: TrainConfig, losses: LossConfig,
                  reference: Callable[[], AbstractContextManager[Any]]) -> tuple[LossTerms, float]:
        """Unpacked: the sequences as rows padded to the longest (for a model whose attention takes
        no custom mask)."""
        length = len(batch[0])
        ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), length), dtype=torch.long)
        rollout = torch.full((len(batch), length), math.nan)
        weights = torch.zeros((len(batch), length))
        advantages = torch.zeros((len(batch), length))
        for row, seq in enumerate(batch):
            n = len(seq)
            ids[row, :n] = torch.tensor(seq.token_ids)
            attention[row, :n] = 1
            rollout[row, :n] = torch.tensor(seq.logprobs)
            weights[row, :n] = torch.tensor(seq.assistant_mask, dtype=torch.float) * seq.weight
            advantages[row, :n] = seq.advantage
        # Only positions that predict a trained token need logits: skip the vocabulary projection
        # (a fifth of a small model's compute) over the prompt. Logits at position t predict
        # token t+1, so predicting tokens first..L-1 takes the logits at first-1..L-2.
        first = min(seq.assistant_mask.index(True) for seq in batch)
        inputs = {"input_ids": ids.to(self.device), "attention_mask": attention.to(self.device), "use_cache": False}
        keep = torch.arange(first - 1, length - 1, device=self.device)

        def features() -> torch.Tensor:
            return self._features(inputs, keep).flatten(0, 1)

        rows = torch.arange(len(batch))[:, None].expand(-1, length)  # each row is a sequence
        targets, rollout, advantages, weights, sequence_ids = (x[:, first:].flatten().to(self.device)
                                                               for x in (ids, rollout, advantages, weights, rows))
        return self._loss_backward_saving_logit_memory(features, targets, rollout, advantages, weights, sequence_ids,
                                                       config, losses, reference)

    def _packed_backward(self, batch: PackedBatch, config: TrainConfig, losses: LossConfig,
                         reference: Callable[[], AbstractContextManager[Any]]) -> tuple[LossTerms, float]:
        """Prefix-tree rows (see packing.py): each trained token's logits come from the one copy
        of its context; features only at the positions some term needs."""
        keep, term_index = torch.unique(batch.term_positions, return_inverse=True)
        inputs: dict[str, Any] = {"input_ids": batch.token_ids.to(self.device),
                                  "position_ids": batch.positions.to(self.device), "use_cache": False}
        attention: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.device.type == "cpu" and getattr(self.base, "_supports_attention_backend", False):
            # only the (query, key) pairs of each token's path (tree_attention.py); a model whose
            # attention transformers cannot swap (custom code) keeps the mask
            inputs["tree_layout"] = tree_layout(batch.parents, batch.token_ids.shape[1], self.device)
            attention = tree_attention_for(self.base)
        else:  # one masked call a layer: per-segment calls on a GPU are not measured yet
            inputs["attention_mask"] = batch.attention_bias(self.base.dtype).to(self.device)
        keep, rows, term_index = keep.to(self.device), batch.term_rows.to(self.device), term_index.to(self.device)

        def features() -> torch.Tensor:
            return self._features(inputs, keep)[rows, term_index]

        with attention:
            return self._loss_backward_saving_logit_memory(features, *(x.to(self.device) for x in (
                batch.term_targets, batch.term_rollout_logprobs, batch.term_advantages, batch.term_weights,
                batch.term_sequences)), config, losses, reference)

    def _features(self, inputs: dict[str, torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
        """What the output head turns into logits, at the positions `keep` of each row: the decoder's
        last hidden states, or the model's logits where the head is the identity."""
        assert self.peft is not None
        if isinstance(self.head, torch.nn.Identity):
            return self.peft(**inputs, logits_to_keep=keep).logits
        return self.base.get_decoder()(**inputs).last_hidden_state[:, keep]

    def _loss_backward_saving_logit_memory(self, features: Callable[[], torch.Tensor], targets: torch.Tensor,
                                           rollout: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                                           sequence_ids: torch.Tensor, config: TrainConfig, losses: LossConfig,
                                           reference: Callable[[], AbstractContextManager[Any]]
                                           ) -> tuple[LossTerms, float]:
        """The loss of one forward's trained tokens (one per row of `features`), its gradients
        accumulated; and their entropy.

        Logits over the whole vocabulary are a step's largest tensors (SmolLM2: 49,152 floats a
        token, several copies through log-softmax and its backward), so they are made from the
        features LOGIT_CHUNK_TOKENS tokens at a time: each chunk's loss runs its backward into a
        detached copy of the features, and the model's backward then runs once from their summed
        gradient. The loss is a weighted sum over tokens, so the chunks' sum is the same loss.
        A sequence-level importance ratio needs every token of the sequence first (a micro-batch
        holds whole sequences): a pass without gradients over the chunks gives it, as it gives the
        KL term's reference logprobs (under `reference`), before the forward that is trained."""
        assert self.peft is not None

        def logprobs(rows: torch.Tensor, chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
            logp_all = torch.log_softmax(self.head(rows).float() / config.temperature, dim=-1)
            return logp_all, logp_all.gather(-1, targets[chunk, None])[:, 0]

        chunks = [slice(start, start + LOGIT_CHUNK_TOKENS) for start in range(0, len(targets), LOGIT_CHUNK_TOKENS)]
        logp_ref = None
        if losses.beta:
            with torch.no_grad(), reference():
                reference_features = features()
                logp_ref = torch.cat([logprobs(reference_features[chunk], chunk)[1] for chunk in chunks])
            del reference_features
        hidden = features()
        detached = hidden.detach().requires_grad_()
        sequence = None
        if losses.kind != "sft" and losses.importance_sampling_level != "token":
            with torch.no_grad():
                logp = torch.cat([logprobs(detached[chunk], chunk)[1] for chunk in chunks])
            sequence = sequence_log_ratio(token_log_ratio(logp, rollout), sequence_ids, weights > 0)
        parts: list[LossTerms] = []
        entropy_sum = 0.0
        for chunk in chunks:
            logp_all, logp_new = logprobs(detached[chunk], chunk)
            terms = (sft_loss(logp_new, weights[chunk]) if losses.kind == "sft" else
                     policy_loss(logp_new, rollout[chunk], advantages[chunk], weights[chunk], losses,
                                 None if logp_ref is None else logp_ref[chunk],
                                 None if sequence is None else sequence[chunk]))
            terms.loss.backward()
            parts.append(LossTerms(terms.loss.detach(), terms.policy_loss, terms.kl, terms.clipped_fraction))
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                entropy_sum += float((entropy * weights[chunk]).sum())
        hidden.backward(detached.grad)
        summed = LossTerms(*(torch.stack([getattr(p, f) for p in parts]).sum() for f in
                             ("loss", "policy_loss", "kl", "clipped_fraction")))
        return summed, entropy_sum

    def _save(self, key: str, optimizer: torch.optim.Optimizer, save_to: Path) -> None:
        assert self.peft is not None
        save_to.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.peft, adapter_name=key)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(save_to / "adapter_model.safetensors"))
        self.peft.peft_config[key].save_pretrained(str(save_to))
        kill_point("checkpoint_half_written")
        torch.save(optimizer.state_dict(), save_to / "optimizer.pt")

"""What ART's config objects mean here, field by field: `_internal_config` (`art.dev.InternalModelConfig`:
init_args, engine_args, peft_args, ...), `lora_config=` (`art.dev.LoRAConfig`) and `_config=` on
train (`art.dev.TrainConfig`).

Each field is applied (a LoRA setting, a TrainConfig setting), mapped to the backend setting of
the same meaning (`art-backend serve --help`, `ART_BACKEND_*`), accepted because its value is what
happens here anyway (said in a note when it changes nothing), or refused by name with the way
forward. No field is dropped silently; every refusal of one call comes in one error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from art_integrations.training import TrainConfig

logger = logging.getLogger(__name__)
_NOTED: set[str] = set()

# (group, field) -> the backend setting of the same meaning
_SETTINGS = {
    ("engine_args", "gpu_memory_utilization"): "gpu_memory_utilization",
    ("engine_args", "max_model_len"): "max_model_len",
    ("engine_args", "max_num_seqs"): "max_batch_size",
    ("engine_args", "tensor_parallel_size"): "tensor_parallel_size",
    ("engine_args", "max_loras"): "max_loras",
    ("engine_args", "max_lora_rank"): "max_lora_rank",
    ("engine_args", "max_cpu_loras"): "max_cpu_loras",
    ("init_args", "max_seq_length"): "max_model_len",
    ("init_args", "gpu_memory_utilization"): "gpu_memory_utilization",
    ("init_args", "max_lora_rank"): "max_lora_rank",
}
# ART 0.5.18's peft_args and 0.5.23's lora_config -> our LoraConfig
_LORA = {"r": "rank", "rank": "rank", "lora_alpha": "alpha", "alpha": "alpha", "target_modules": "target_modules"}
# values that are what happens here anyway: accepted, nothing to change
_AS_HERE: dict[tuple[str, str], Any] = {
    ("engine_args", "enable_lora"): True,
    ("peft_args", "lora_dropout"): 0, ("lora_config", "dropout"): 0,
    ("peft_args", "bias"): "none", ("lora_config", "bias"): "none",
    ("init_args", "load_in_4bit"): False, ("init_args", "load_in_8bit"): False, ("init_args", "full_finetuning"): False,
    ("config", "rollout_weights_mode"): "lora", ("config", "rollout_weight_update_mode"): "step_lora",
    ("config", "allow_unvalidated_arch"): True,
    ("_config", "allow_training_without_logprobs"): True,
    ("_config", "advantage_balance"): 0.0,
    ("_config", "mask_prob_ratio"): False,
    ("_config", "kimi_k2_tau"): None,
    ("_config", "kl_penalty_coef"): 0.0,
    ("_config", "kl_ref_adapter_path"): None,
    ("_config", "kl_penalty_reference_step"): None,
    ("_config", "max_negative_advantage_importance_sampling_weight"): None,
    ("_config", "num_trajectories_learning_rate_multiplier_power"): 0.0,
    ("_config", "plot_tensors"): False,
    ("_config", "scale_learning_rate_by_reward_std_dev"): False,
    ("_config", "save_checkpoint"): True,
    ("_config", "loss_fn_config"): None,
    ("_config", "adam_params"): None,
}
# fields that change how ART computes, not what it trains: accepted, with a note on what does it here
_NO_EFFECT = {
    ("_config", "logprob_calculation_chunk_size"): "a memory knob of ART's logprob pass; here "
    "TrainConfig(micro_batch_tokens=...) bounds the trainer's memory per pass",
    ("_config", "precalculate_logprobs"): "the rollout's own logprobs are used here, never recomputed before the step",
    ("_config", "optimizer_save_interval"): "the optimizer state is saved with every step's checkpoint here",
    ("_config", "final_training_step"): "it marks when ART saves the optimizer state, which is saved every step here",
    ("_config", "kl_penalty_source"): "it picks the policy of ART's KL penalty, which is off (kl_penalty_coef 0, the "
    "only value taken here; TrainConfig(beta=..., kl_reference_step=...) is the KL term here)",
    ("_config", "verbose"): "the backend logs each step; its metrics come back in the result",
    ("_config", "truncated_importance_sampling"): "it corrects ART's recomputed old logprobs towards the sampler's "
    "(times min(exp(old - sampler), bound)); here the old logprobs are the sampler's own, never recomputed, so that "
    "factor is 1 (docs/training/grpo.md)",
}
# ART's _config fields that are TrainConfig fields here
_TRAIN = {"epsilon": "epsilon", "epsilon_high": "epsilon_high", "scale_rewards": "scale_rewards",
          "normalize_advantages": "scale_rewards", "loss_fn": "loss",
          "importance_sampling_level": "importance_sampling_level"}
_WAY_FORWARD = {
    "init_args": "Unsloth's loading arguments are the trainer's own here; the base model is the backend's "
                 "(`art-backend serve --model`, ART_BACKEND_MODEL)",
    "engine_args": "the backend's settings are listed by `art-backend serve --help` (ART_BACKEND_* variables)",
    "peft_args": "the adapter is lora=LoraConfig(rank=..., alpha=..., target_modules=...)",
    "lora_config": "the adapter is lora=LoraConfig(rank=..., alpha=..., target_modules=...)",
    "trainer_args": "step settings are TrainConfig's (learning_rate, max_grad_norm, ...), passed to train()",
    "config": "engine and trainer placement and chat templates are the backend's (`art-backend serve --help`: "
              "--tensor-parallel-size, --data-parallel-size; the model's own chat template)",
    "_config": f"TrainConfig's fields are: {', '.join(TrainConfig.model_fields)}",
}
_REFUSED_WHY = {
    ("engine_args", "model"): "the backend serves one base model: TrainableModel(base_model=...) names it and "
                              "`art-backend serve --model` (ART_BACKEND_MODEL) sets it",
    ("engine_args", "served_model_name"): "models are served as `name` and `name@step`",
    ("init_args", "model_name"): "TrainableModel(base_model=...) names the base model",
    ("_config", "ppo"): "ours is TrainConfig(loss=\"ppo\") (or \"cispo\", the default)",
    ("_config", "kl_penalty_coef"): "the nearest is TrainConfig(beta=...), a KL term in the loss toward the base "
                                    "model, or with kl_reference_step=N toward step N's checkpoint (ART adjusts "
                                    "advantages instead)",
    ("_config", "kl_penalty_reference_step"): "ours is TrainConfig(beta=..., kl_reference_step=N): a KL term in the "
                                              "loss toward step N's checkpoint",
    ("_config", "packed_sequence_length"): "ours is TrainConfig(micro_batch_tokens=...) (groups are always packed)",
    ("_config", "grad_accumulation_sequences"): "ours is TrainConfig(micro_batch_tokens=...), tokens per "
                                                "forward/backward pass",
    ("_config", "save_checkpoint"): "every step is saved and served as `name@step`",
}


class ArtConfigError(ValueError):
    """Fields of ART's config objects that mean nothing here, each with the way forward."""


@dataclass
class Mapped:
    settings: dict[str, Any] = field(default_factory=dict)  # BackendSettings fields
    lora: dict[str, Any] = field(default_factory=dict)  # LoraConfig fields
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    notes: list[str] = field(default_factory=list)  # fields taken that change nothing here, and why
    refused: list[str] = field(default_factory=list)

    def take(self, group: str, name: str, value: Any) -> None:
        where = f"{group}.{name}" if group not in ("config", "_config") else name
        if (group, name) in _SETTINGS:
            self._set(self.settings, _SETTINGS[group, name], value, where)
        elif group in ("peft_args", "lora_config") and name in _LORA:
            self._set(self.lora, _LORA[name], value, where)
        elif group == "_config" and name in _TRAIN:
            self._set(self.train, _TRAIN[name], value, where)
        elif (group, name) == ("_config", "ppo") and isinstance(value, bool):
            self._set(self.train, "loss", "ppo" if value else "cispo", where)
        elif (group, name) in _AS_HERE and value == _AS_HERE[group, name]:
            return
        elif (group, name) in _NO_EFFECT:
            self.notes.append(f"{where}={value!r} is taken but changes nothing: {_NO_EFFECT[group, name]}")
        elif group == "engine_args" and (group, name) not in _REFUSED_WHY and (group, name) not in _AS_HERE:
            # vLLM's own engine arguments, passed to vLLM as they are (it refuses those it does not know)
            self.settings.setdefault("vllm_engine_args", {})[name] = value
        else:
            why = _REFUSED_WHY.get((group, name))
            if why is None and (group, name) in _AS_HERE:
                why = f"here it is always {_AS_HERE[group, name]!r}"
            self.refused.append(f"{where}={value!r} ({why or _WAY_FORWARD[group]})")

    def _set(self, target: dict[str, Any], key: str, value: Any, where: str) -> None:
        if key in target and target[key] != value:
            self.refused.append(f"{where}={value!r} (it sets {key}, already {target[key]!r} from another field)")
        target[key] = value

    def check(self, what: str) -> Mapped:
        """Refuse what is not taken, all at once; say what is taken but changes nothing."""
        if self.refused:
            raise ArtConfigError(f"{what}: not taken here: {'; '.join(self.refused)}.")
        for note in self.notes:
            if note not in _NOTED:  # once per process: a training loop would repeat it every step
                _NOTED.add(note)
                logger.warning("%s: %s", what, note)
        return self


def from_internal_config(config: Mapping[str, Any]) -> Mapped:
    """ART's `InternalModelConfig` as backend settings and LoRA settings."""
    mapped = Mapped()
    for group, value in config.items():
        if group in ("init_args", "engine_args", "peft_args", "lora_config") and isinstance(value, Mapping):
            for name, setting in value.items():
                mapped.take(group, name, setting)
        elif group in ("init_args", "engine_args", "peft_args", "lora_config", "trainer_args"):
            mapped.refused.append(f"{group} ({_WAY_FORWARD[group]})")
        else:
            mapped.take("config", group, value)
    return mapped.check("_internal_config")


def from_lora_config(config: Mapping[str, Any]) -> Mapped:
    """ART 0.5.23's `TrainableModel(lora_config=LoRAConfig(...))` as LoRA settings."""
    mapped = Mapped()
    for name, value in config.items():
        mapped.take("lora_config", name, value)
    return mapped.check("lora_config")


def train_config_with(config: TrainConfig, art: Mapping[str, Any], what: str = "_config") -> TrainConfig:
    """`config` with ART's `_config=` (`art.dev.TrainConfig`), or ART's keywords of `backend.train`,
    applied; a field set in both to different values is refused."""
    mapped = Mapped()
    for name, value in art.items():
        mapped.take("_config", name, value)
    for key, value in mapped.train.items():
        if key in config.model_fields_set and getattr(config, key) != value:
            mapped.refused.append(f"it sets {key}={value!r}, but the TrainConfig says {getattr(config, key)!r}")
    mapped.check(what)
    return TrainConfig.model_validate({**config.model_dump(), **mapped.train})


def settings_environment(settings: Mapping[str, Any]) -> dict[str, str]:
    """These backend settings as the ART_BACKEND_* variables it reads at start."""
    return {f"ART_BACKEND_{key.upper()}": json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            for key, value in settings.items()}


def settings_variables(settings: Mapping[str, Any]) -> str:
    """How to give the backend these settings when it starts: its ART_BACKEND_* variables."""
    return ", ".join(f"{name}={value}" for name, value in settings_environment(settings).items())

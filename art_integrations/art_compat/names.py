"""ART's names that mean something else here or nothing, each with the way forward, in one place: a
ported script fails on the name with what to use instead, never with a bare AttributeError or a
dropped argument. `StrictModel` refuses the fields (`ART_NAMES`), `Model` and `Backend` the methods
(`ART_METHODS`), the package `art_integrations` its top-level names."""

from __future__ import annotations

from collections.abc import Mapping


# ART's top-level names (`art.X`) that have no counterpart here, each with what to use instead
PACKAGE_NAMES: dict[str, str] = {
    "auto_trajectory": "art_capture() records every model call of a rollout into its trajectory",
    "capture_auto_trajectory": "`async with art_capture() as trajectory:` around the rollout",
    "yield_trajectory": "return the Trajectory from the rollout",
    "capture_yielded_trajectory": "return the Trajectory from the rollout",
    "ServerlessBackend": "RemoteBackend(url, api_key=...) reaches an art-backend anywhere; RayBackend(num_gpus=1, "
                         "checkpoint_store=...) starts one on a GPU node of a Ray cluster",
    "trajectory_group_batches": "iterate_dataset(...) batches scenarios into steps",
    # ART 0.5.23's
    "LocalTrainResult": "model.train() and backend.train() return TrainResult (step, metrics); checkpoints are "
                        "served as `name@step` once it returns",
    "ServerlessTrainResult": "model.train() and backend.train() return TrainResult (step, metrics)",
    "LocalServingUnavailableError": "a backend that cannot serve raises BackendError, naming why",
    "MegatronRuntimeConfig": "the backend trains LoRA with its own trainer (peft or Unsloth): `art-backend serve "
                             "--help` lists its settings",
    "MegatronTopologyConfig": "the backend's parallelism is vLLM's: --tensor-parallel-size, --data-parallel-size",
    "get_megatron_runtime_config": "the backend's settings are listed by `art-backend serve --help`",
    "init_megatron_runtime_config": "the backend's settings are listed by `art-backend serve --help`",
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS": "each step's metrics come back from train() and go to history.jsonl",
    "PIPELINE_RL_METRIC_DEFINITIONS": "each step's metrics come back from train() and go to history.jsonl",
    "PIPELINE_RL_SCORE_METRICS": "each step's metrics come back from train() and go to history.jsonl",
    "MetricDefinition": "log metrics per trajectory (Trajectory.metrics) or with model.log(groups)",
    "get_tokenizer": "the backend tokenizes: every response carries its token_ids and prompt_token_ids",
    "tokenize": "the backend tokenizes trajectories itself from their exact token ids",
    "tensorize": "the backend builds the training tensors itself",
}

# ART's `art.pipeline_trainer` names that have no counterpart here
PIPELINE_TRAINER_NAMES: dict[str, str] = {
    "StatusReporter": "PipelineTrainer prints its own progress: a line per step and eval, one on the three stages "
                      "every log_interval_seconds, and a summary",
    **dict.fromkeys(["CheckpointInfo", "CheckpointRetentionContext", "CheckpointRetentionStrategy",
                     "keep_recent_and_top", "CHECKPOINT_CREATED_AT_METRIC", "CHECKPOINT_EVAL_COMPLETED_METRIC",
                     "CHECKPOINT_SAVED_METRIC"],
                    "every step is kept; await model.delete_checkpoints() keeps the newest and the best"),
}

# ART's `Model` fields named differently here, or not here
MODEL_FIELDS: dict[str, str] = {
    "entity": "the W&B entity comes from WANDB_ENTITY",
    "id": "a run is named by `project` and `name`",
    "trainable": "use art_integrations.TrainableModel to train, Model to only score",
    "base_path": "the art dir belongs to the backend: LocalBackend(art_dir=...) or `art-backend serve --art-dir`",
    "_internal_config": "a Model is only scored here, with no engine of its own: engine settings belong to the "
                        "backend (`art-backend serve --help`, ART_BACKEND_* variables), and a TrainableModel "
                        "takes ART's _internal_config",
}

# ART's `TrainableModel` fields named differently here, or not here (beyond `Model`'s)
TRAINABLE_MODEL_FIELDS: dict[str, str] = {
    **MODEL_FIELDS,
    "run_name": "checkpoints are stored and served under `name` here: pass run_name equal to name, or leave it out",
}

# ART's `Model` methods that have no counterpart here, each with what to use instead
MODEL_METHODS: dict[str, str] = {
    "litellm_completion_params": "LiteLLM reaches the model as f\"openai/{model.get_inference_name()}\" with "
                                 "api_base=model.inference_base_url, api_key=model.inference_api_key",
    "read_state": "keep run state in your script, in a file of its own",
    "write_state": "keep run state in your script, in a file of its own",
    "merge_state": "keep run state in your script, in a file of its own",
    "overwrite_state": "keep run state in your script, in a file of its own",
    "update_wandb_config": "model.metrics_reporter is the W&B reporter; WANDB_* variables configure its run",
    "metrics_builder": "put metrics on Trajectory.metrics, or record a split with model.log(groups, split=...)",
    "activate_metrics_context": "put metrics on Trajectory.metrics, or record a split with model.log(groups, "
                                "split=...)",
    "cost_calculator": "no cost accounting here: count tokens from each response's usage",
    "set_cost_calculator": "no cost accounting here: count tokens from each response's usage",
}

# ART's backend methods that have no counterpart here, each with what to use instead
BACKEND_METHODS: dict[str, str] = {
    "_experimental_pull_model_checkpoint": "backend.pull_checkpoints(model, url, step=N) brings step N into the "
                                           "backend's art dir, served as `name@N` once the model registers",
    "_experimental_fork_checkpoint": "pull the other model's steps with backend.pull_checkpoints(other, url) and "
                                     "train that model; one model is not forked into another here",
    "adapter_lease": "every checkpoint is served as `name@step` until model.delete_checkpoints() removes it",
    "exact_adapter_lease": "every checkpoint is served as `name@step` until model.delete_checkpoints() removes it",
    "adapter_retention_lease": "every checkpoint is served as `name@step` until model.delete_checkpoints() "
                               "removes it",
    "prune_model_adapters": "model.delete_checkpoints() keeps the latest and the best step",
}

# ART's `TrainConfig` and `backend.train()` settings named differently here, or not here
TRAIN_CONFIG_FIELDS: dict[str, str] = {
    "kl_penalty_coef": "the nearest is `beta`, a KL term in the loss toward the base model, or with "
                       "`kl_reference_step=N` toward step N's checkpoint (ART adjusts advantages instead)",
    "kl_penalty_reference_step": "ours is `kl_reference_step`, with `beta` > 0: the checkpoint the KL term is "
                                 "measured against",
    "loss_fn": "ours is `loss` (\"cispo\" or \"ppo\")",
    "normalize_advantages": "ours is `scale_rewards` (divide advantages by the group's reward std)",
    "grad_accumulation_sequences": "ours is `micro_batch_tokens` (tokens per forward/backward pass)",
    "packed_sequence_length": "ours is `micro_batch_tokens` (groups are always packed as prefix trees)",
    "precalculate_logprobs": "not needed: the rollout's own logprobs are used where they came with it",
    "allow_training_without_logprobs": "always so here: a turn without logprobs trains with importance ratio 1",
    "save_checkpoint": "every step is saved and served as `<name>@<step>`",
    # ART 0.5.23's: they change when ART saves the optimizer and which policy its KL uses; taken (with a note
    # that they change nothing here) as `backend.train(model, groups, ...)` keywords or `model.train(_config=...)`
    "kl_penalty_source": "pass it to backend.train() or model.train(_config={...}), which take it (ART's KL "
                         "penalty is off here; `beta` is the KL term)",
    "optimizer_save_interval": "pass it to backend.train() or model.train(_config={...}), which take it (the "
                               "optimizer state is saved every step here)",
    "final_training_step": "pass it to backend.train() or model.train(_config={...}), which take it (the "
                           "optimizer state is saved every step here)",
}


def refuse_art_name(owner: str, name: str, table: Mapping[str, str], kind: str) -> None:
    """Raise the AttributeError for ART's `name`, which `owner` lacks, with the way forward from
    `table`; return where `name` is not one of ART's, for the caller's own lookup."""
    if name in table:
        raise AttributeError(f"{owner} has no {name!r} (an ART {kind}): {table[name]}")

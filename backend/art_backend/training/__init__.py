"""GRPO training: trajectory groups -> token sequences -> a LoRA step -> a served checkpoint."""

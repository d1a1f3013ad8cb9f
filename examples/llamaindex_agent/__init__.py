"""A LlamaIndex FunctionAgent that converts units with tools, trained with GRPO."""

"""A LangGraph supervisor that delegates lookups to a research sub-agent; both are trained with GRPO."""

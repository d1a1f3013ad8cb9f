"""The main job: a LangGraph tool agent answering questions about cities, trained with GRPO."""

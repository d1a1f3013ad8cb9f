"""An email-search agent in the spirit of OpenPipe's ART-E: LangGraph, a synthetic SQLite inbox, GRPO."""

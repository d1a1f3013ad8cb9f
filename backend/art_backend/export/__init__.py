"""Export a trained checkpoint for vLLM, transformers, llama.cpp and Ollama (`art-backend export`,
`model.export(...)`): see `exporter.py`."""

from art_backend.export.exporter import (
    DEFAULT_GGUF_QUANT,
    FORMATS,
    BaseModel,
    ExportError,
    ExportSpaceError,
    Format,
    Plan,
    build,
    plan,
    stored_model,
)

__all__ = ["DEFAULT_GGUF_QUANT", "FORMATS", "BaseModel", "ExportError", "ExportSpaceError", "Format", "Plan", "build",
           "plan", "stored_model"]

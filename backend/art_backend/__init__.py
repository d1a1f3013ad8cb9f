"""art-backend: an OpenAI-compatible serving and GRPO training service.

The HTTP layer (`server`) talks to an `Engine` (`engine.base`); the embedded engine is
`engine.torch_engine.TorchEngine`, running any Llama-family Hugging Face model on CPU or one GPU.
"""

from art_backend.config import BackendSettings

__version__ = "0.1.0"
__all__ = ["BackendSettings", "__version__"]

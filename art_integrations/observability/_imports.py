"""Optional SDKs are imported only when a feature that needs them is switched on, so the
client stays light; a missing one is named together with the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{feature} needs the {module} package, which is not installed ({error}). "
            f'Install it with: pip install "art-integrations[{extra}]"') from error

"""Package boundaries and model resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from art_backend.model_store import ModelNotFoundError, resolve_model_dir


def _python(code: str) -> str:
    """`code` run by a fresh interpreter of this venv; its stdout, once it exited cleanly."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_client_package_imports_without_torch() -> None:
    # `None` in sys.modules makes any `import torch` fail, as in an environment without it.
    _python("import sys; sys.modules['torch'] = None; import art_integrations; print(art_integrations.__version__)")


def test_client_package_imports_without_ray_and_says_which_extra_the_runner_needs() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
            "from art_integrations import RayRollouts\n"
            "runner = RayRollouts(address='auto', num_cpus=0.5)  # configuring it needs no Ray\n"
            "try:\n"
            "    runner.connect()\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    printed = _python(code)
    assert 'RayRollouts needs Ray' in printed and 'pip install "art-integrations[ray]"' in printed


def test_the_backend_imports_only_the_clients_data_types_and_every_public_name_resolves() -> None:
    """The backend's server loads the client's trajectory and config types, not its HTTP clients or
    the openai SDK (a second a start); the names it leaves unloaded still resolve on first use."""
    code = ("import sys, art_backend.app, art_integrations\n"
            "assert 'openai' not in sys.modules and 'art_integrations.backend' not in sys.modules, 'loaded'\n"
            "missing = [name for name in art_integrations.__all__ if getattr(art_integrations, name, None) is None]\n"
            "assert not missing, missing\n"
            "assert art_integrations.trajectory.__module__ == 'art_integrations.capture'  # the function\n"
            "assert set(art_integrations.__all__) <= set(dir(art_integrations))\n"
            "print(art_integrations.LocalBackend.__module__)\n")
    assert _python(code).strip() == "art_integrations.backend"


def test_a_directory_without_a_model_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="save_pretrained"):
        resolve_model_dir(str(tmp_path), tmp_path / "cache")


def test_the_embedded_model_is_the_default_and_is_cached(cache_dir: Path, embedded_model_dir: Path) -> None:
    assert resolve_model_dir(None, cache_dir) == embedded_model_dir
    assert (embedded_model_dir / "model.safetensors").is_file()
    assert (embedded_model_dir / "tokenizer.json").is_file()


def test_any_local_model_directory_can_be_served(tiny_model_dir: Path, cache_dir: Path) -> None:
    assert resolve_model_dir(str(tiny_model_dir), cache_dir) == tiny_model_dir

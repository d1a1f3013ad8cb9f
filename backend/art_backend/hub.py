"""Models named by Hugging Face hub id (`Qwen/Qwen2.5-7B-Instruct`), resolved to a snapshot
directory of huggingface_hub's cache and downloaded into it when missing.

huggingface_hub owns the cache and reads its own settings (HF_HOME, HF_HUB_CACHE, HF_TOKEN,
HF_HUB_OFFLINE, HF_ENDPOINT), so a model fetched here is the one vLLM, transformers and
`hf download` find, and the reverse. Each of its failures becomes one `ModelNotFoundError`
that names the id and what to do.
"""

from __future__ import annotations

import logging
from pathlib import Path

from art_backend.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

# What serving and training read: config, generation config, tokenizer and chat template files,
# safetensors weights (and their index). The same weights in other formats (.bin, .pth, .gguf,
# onnx/ and original/ folders) stay on the hub: top-level files only.
_MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_OTHER_FOLDERS = ["*/*"]


def hub_model_dir(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of `repo_id` at `revision` (default main), downloaded first when the
    cache lacks it (with huggingface_hub's progress bars)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cache = constants.HF_HUB_CACHE
    logger.info("Resolving the hub model %s (cache %s%s)", at, cache, ", offline" if constants.HF_HUB_OFFLINE else "")
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_MODEL_FILES,
                                          ignore_patterns=_OTHER_FOLDERS))
    except HFValidationError as error:
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a local directory nor a hub id ({error}). Pass an existing model directory "
            "(a path starting with / or ./), or a hub id as its page names it, e.g. Qwen/Qwen2.5-7B-Instruct."
        ) from error
    except GatedRepoError as error:  # before RepositoryNotFoundError: it is one
        raise ModelNotFoundError(
            f"The hub model {repo_id!r} is gated: accept its terms on {constants.ENDPOINT}/{repo_id} while logged "
            "in, then set HF_TOKEN to a token of that account (or run `hf auth login`) and start again."
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelNotFoundError(
            f"No hub model {repo_id!r} at {constants.ENDPOINT}, and no directory of that name here: check the id's "
            "spelling (org/name, as on its page); for a private model set HF_TOKEN to a token that may read it; "
            f"for a local directory pass its path (e.g. ./{repo_id})."
        ) from error
    except RevisionNotFoundError as error:
        raise ModelNotFoundError(
            f"The hub model {repo_id!r} has no revision {revision!r}: pass a branch, tag or commit it has "
            "(--revision, ART_BACKEND_REVISION), or leave the revision unset for main."
        ) from error
    except LocalEntryNotFoundError as error:  # not cached (or in part), and the hub not asked or not reached
        why, fix = (("HF_HUB_OFFLINE=1 forbids downloading it", "Unset HF_HUB_OFFLINE to download it") if
                    constants.HF_HUB_OFFLINE else
                    (f"the hub at {constants.ENDPOINT} could not be reached ({error.__cause__!r})",
                     "Check the connection (a proxy, HF_ENDPOINT)"))
        download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ModelNotFoundError(
            f"The hub model {at} is not in the hub cache {cache} (or only in part), and {why}. {fix}; or download it "
            f"where the hub is reachable (`{download}`) and point HF_HUB_CACHE or HF_HOME at that cache; or pass a "
            "local model directory."
        ) from error
    except HfHubHTTPError as error:  # the hub answered with another error (overloaded, down, refusing the token)
        raise ModelNotFoundError(
            f"The hub at {constants.ENDPOINT} refused the model {at}: {error}. Try again later, or check HF_TOKEN."
        ) from error
    if not (snapshot / "config.json").is_file():
        raise ModelNotFoundError(f"The hub model {at} has no config.json: it is not a transformers model "
                                 "(a GGUF-only or adapter repo?). Pass the id of the model itself.")
    if not any(snapshot.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"The hub model {at} has no safetensors weights (only other formats, e.g. .bin or .gguf, which are not "
            "downloaded). Pick a repo with safetensors, or convert it and pass the local directory.")
    return snapshot


def cached_hub_model_dir(repo_id: str) -> Path | None:
    """The snapshot of `repo_id` at main in the hub cache, or None when the cache lacks it (nothing is
    downloaded, whatever HF_HUB_OFFLINE says)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=_MODEL_FILES, ignore_patterns=_OTHER_FOLDERS,
                                          local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return snapshot if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")) else None

"""Names on the Hugging Face Hub: telling a Hub id from a local path, and downloading a model.

``model.path``, ``teacher.path`` and ``task.dataset.train_file`` take either a local path or a
Hub name (``org/name``).
A name reads as local when it starts like a path (``./``, ``../``, ``/``, ``~``), has more than
one ``/``, or its first directory exists here (``outputs/...`` in a run's working directory);
then a missing path is an error, never a download. Anything else that is a valid Hub id is one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "download_hint",
    "download_model",
    "download_on_main",
    "first_line",
    "is_hub_name",
]

# A model repository's config and tokenizer (chat template included): what the vocabulary check
# of a teacher served elsewhere needs.
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# What a causal LM needs: those and its weights (not the duplicate weights some ship for other
# frameworks: original/*.pth, *.gguf, onnx/).
MODEL_FILES = [*TOKENIZER_FILES, "*.safetensors"]


def is_hub_name(name: str) -> bool:
    """True when ``name`` is a valid Hub id that does not read as a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1:
        return False
    if Path(name).exists() or ("/" in name and Path(name).parent.is_dir()):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_hint(name: str, repo_type: str = "model") -> str:
    """The command that downloads ``name`` into a local directory, for an error message."""
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    folder = "models" if repo_type == "model" else "data"
    return f"`hf download {name}{kind} --local-dir {folder}/{name.split('/')[-1]}`"


def first_line(err: BaseException) -> str:
    """``Type: first line of the message``: an error of a library, for a one-line message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def download_model(repo_id: str, *, weights: bool = True) -> str:
    """The local snapshot directory of Hub model ``repo_id`` (in the Hugging Face cache),
    downloaded first if needed: its config, tokenizer files and (``weights``) its weights."""
    import huggingface_hub

    if not weights:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=TOKENIZER_FILES)
    local = huggingface_hub.snapshot_download(repo_id, allow_patterns=MODEL_FILES)
    if not any(Path(local).glob("*.safetensors")):  # an older repository: PyTorch weights only
        local = huggingface_hub.snapshot_download(repo_id, allow_patterns=[*MODEL_FILES, "*.bin"])
    return local


def download_on_main(
    repo_id: str,
    key: str,
    dist_info: Any,
    log: Callable[[str], None] = print,
    *,
    weights: bool = True,
) -> str:
    """:func:`download_model` of ``repo_id`` (the value of config key ``key``) on every rank,
    downloaded once: the main process first, then the others find it in the cache (or, on
    another node without a shared cache, download their own copy). ``dist_info``: a
    :class:`~microrl.run.dist.Dist` (its ``is_main`` and collective ``any``, whose wait is bounded
    by the process group's timeout). A failure on the main process is a one-line ``ValueError``
    on every rank naming ``key`` and saying how to download by hand."""
    local, error = None, None
    if dist_info.is_main:
        log(f"{key}={repo_id} is not a local directory: loading it from the Hugging Face Hub")
        try:
            local = download_model(repo_id, weights=weights)
        except Exception as err:  # network, unknown or gated repository, disk: all one line
            error = err
    if dist_info.any(error is not None):
        reason = first_line(error) if error is not None else "see rank 0"
        raise ValueError(
            f"{key}={repo_id!r} is not a local directory, and downloading it from the "
            f"Hugging Face Hub failed ({reason}); download it with {download_hint(repo_id)} "
            f"(`huggingface-cli download` on older hubs) and give {key}=models/"
            f"{repo_id.split('/')[-1]}"
        )
    return local if local is not None else download_model(repo_id, weights=weights)

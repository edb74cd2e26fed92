"""Names on the Hugging Face Hub: telling a Hub id from a local path, and downloading a model.

``model.path`` and ``task.train_file`` take either a local path or a Hub name (``org/name``).
A name reads as local when it starts like a path (``./``, ``../``, ``/``, ``~``), has more than
one ``/``, or its first directory exists here (``outputs/...`` in a run's working directory);
then a missing path is an error, never a download. Anything else that is a valid Hub id is one.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["download_hint", "download_model", "first_line", "is_hub_name"]

# What a causal LM needs from a model repository: config, weights, tokenizer and chat template
# (not the duplicate weights some ship for other frameworks: original/*.pth, *.gguf, onnx/).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


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


def download_model(repo_id: str) -> str:
    """The local snapshot directory of Hub model ``repo_id`` (in the Hugging Face cache),
    downloaded first if needed: its config, weights and tokenizer files."""
    import huggingface_hub

    local = huggingface_hub.snapshot_download(repo_id, allow_patterns=MODEL_FILES)
    if not any(Path(local).glob("*.safetensors")):  # an older repository: PyTorch weights only
        local = huggingface_hub.snapshot_download(repo_id, allow_patterns=[*MODEL_FILES, "*.bin"])
    return local

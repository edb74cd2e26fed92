"""The helpers every config section is written with: a field with its help, a range check.

A field's one-line ``--help`` description is its ``metadata["help"]``, written beside it with
:func:`config_field` (:func:`microrl.configs.loader.describe_config` reads it back). A section's
``__post_init__`` checks its ranges with :func:`require` (:func:`require_bool` for a flag),
whose message names the key.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["config_field", "require", "require_bool"]


def config_field(default: Any, help: str) -> Any:
    """A dataclass field with default ``default`` and the one-line ``--help`` text ``help``.

    A list or dict default is copied for each instance (a dataclass cannot share a mutable
    default).
    """
    if isinstance(default, (list, dict)):
        kind, items = type(default), default.copy()
        return field(default_factory=lambda: kind(items), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def require(condition: bool, key: str, rule: str, value: object) -> None:
    """``ValueError("<key> must be <rule>, got <value>")`` unless ``condition``.

    The message starts with the key, which :func:`microrl.configs.loader.load_config` reads to
    prefix it with the section a nested config sits in.
    """
    if not condition:
        raise ValueError(f"{key} must be {rule}, got {value!r}")


def require_bool(value: object, key: str) -> None:
    """:func:`require` that ``key`` is a bool: YAML's true or false (a string "false" is truthy)."""
    require(isinstance(value, bool), key, "a bool (true or false)", value)

"""Load a typed config: dataclass defaults <- a YAML file <- ``key.sub=value`` overrides.

OmegaConf structured configs do the merging, YAML typing and type checking; the dataclasses'
``__post_init__`` checks the ranges. Every failure comes out as one ``ValueError`` whose message
names the offending key, whichever layer caught it::

    cfg = load_config(GRPOExampleConfig, "configs/grpo_lora.yaml", ["actor.optim.lr=1e-3"])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "config_changes",
    "config_to_yaml",
    "describe_config",
    "format_value",
    "load_config",
    "override_value",
]

T = TypeVar("T")


def _omegaconf_error(err: OmegaConfBaseException, source: str) -> ValueError:
    key = getattr(err, "full_key", None) or "<root>"
    # OmegaConf appends its own "full_key / object_type" lines; the first line is the message.
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"invalid config key '{key}' ({source}): {message}")


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ValueError(f"config override {item!r} must have the form key.sub=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, "command-line override") from None


def load_config(
    schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """Build a ``schema`` instance from its defaults, the YAML at ``path``, then ``overrides``.

    Args:
        schema: a dataclass type (nested dataclasses, enums, optionals and lists are supported).
        path: a YAML file whose keys are a subset of the schema's; ``None`` uses the defaults only.
        overrides: ``"key.sub=value"`` strings; values are parsed as YAML (``1e-3``, ``null``,
            ``[a, b]``).

    Raises:
        ValueError: an unknown key, a value of the wrong type or out of range, a malformed
            override or a missing file; the message names the key.
    """
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    cfg = OmegaConf.structured(schema)
    layers: list[tuple[str, Any]] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        try:
            layers.append((f"file {path}", OmegaConf.load(path)))
        except Exception as err:  # a YAML syntax error is not an OmegaConf error
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    layers.append(("command-line override", _parse_overrides(overrides)))
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, source) from None
    return _instantiate(cfg)


def _instantiate(cfg: DictConfig) -> Any:
    # Build each top-level section alone first so a range error raised by a nested dataclass's
    # __post_init__ (which only knows its own field names) can be prefixed with its section.
    for name in cfg:
        section = cfg[name]
        if not OmegaConf.is_dict(section):
            continue
        try:
            OmegaConf.to_object(section)
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, "values") from None
        except (ValueError, TypeError) as err:
            raise _range_error(err, section=str(name)) from None
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, "values") from None
    except (ValueError, TypeError) as err:
        raise _range_error(err, section=None) from None


# "lora.rank must be >= 0, got -1" -> the key is "lora.rank" (relative to the section).
_LEADING_KEY = re.compile(r"^([A-Za-z_][\w.]*) must ")


def _range_error(err: Exception, section: str | None) -> ValueError:
    message = str(err)
    match = _LEADING_KEY.match(message)
    if match is None:
        where = f"section '{section}'" if section else "config"
        return ValueError(f"invalid {where}: {message}")
    key = match.group(1)
    if section and not key.startswith(f"{section}."):
        key = f"{section}.{key}"
    return ValueError(f"invalid config key '{key}': {message}")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_to_yaml(config: Any) -> str:
    """The YAML of a config instance (enums by value), e.g. to save beside a run's outputs;
    ``load_config`` reads it back to an equal instance."""
    return yaml.safe_dump(_plain(config), sort_keys=False)


def override_value(overrides: Sequence[str], key: str, default: Any = None) -> Any:
    """The value the ``key.sub=value`` overrides give ``key`` (the last one wins), parsed as
    :func:`load_config` parses it, or ``default``; a malformed override is a ``ValueError``."""
    return OmegaConf.select(_parse_overrides(overrides), key, default=default)


def format_value(value: Any) -> str:
    """A config value as it is written in YAML and on the command line: ``null``, ``true``,
    ``0.001``, ``[0.9, 0.999]``, ``token-mean``."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=1_000_000)
    return text.strip().removesuffix("...").strip()


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def describe_config(config: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(key.sub, value as YAML, one-line description)`` of every leaf of a config instance.

    A description is the field's ``metadata["help"]`` (:func:`microrl.configs.fields.config_field`),
    ``""`` when it has none.
    """
    rows = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe_config(value, f"{prefix}{f.name}.")
        else:
            rows.append((prefix + f.name, format_value(value), f.metadata.get("help", "")))
    return rows


def config_changes(before: Any, after: Any) -> list[tuple[str, str, str]]:
    """``(key.sub, old, new)`` for every leaf whose value differs (values as YAML)."""
    old, new = _flat(before), _flat(after)
    return [
        (key, format_value(old.get(key)), format_value(new.get(key)))
        for key in list(new) + [k for k in old if k not in new]
        if _plain(old.get(key)) != _plain(new.get(key))
    ]

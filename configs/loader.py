"""Load a typed config: dataclass defaults <- a YAML file <- ``key.sub=value`` overrides.

OmegaConf structured configs do the merging, YAML typing and type checking; the dataclasses'
``__post_init__`` checks the ranges. Every failure comes out as one ``ValueError`` whose message
names the offending key by its full path (``actor.optim.betas``), whichever layer caught it: a
merge error OmegaConf raises without a key is traced to the leaf that causes it, and a range error
of a nested section's ``__post_init__`` is prefixed with where the section sits. A key the schema
lacks is an ``invalid config key``; a schema key's wrong value is a ``bad value for config key``,
with the value given and what the key takes, and an unknown key with the closest known one
(an old key's new name). A single value given to a list key is a one-element list
(``task.rewards.functions=my:score``).

A key a section has renamed (its ``RENAMED_KEYS``, old -> new, relative to the section) is read
under its new name for one release, with a ``FutureWarning`` naming the new key, in a YAML file,
an override and a run's saved config alike; an API key a section has retired (its
``SECRET_KEYS``: old key -> the endpoint that now names an environment variable) is moved into an
environment variable of this process, never echoed::

    cfg = load_config(GRPOExampleConfig, "configs/grpo_lora.yaml", ["actor.optim.lr=1e-3"])
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
import warnings
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
    "renamed_keys",
]

T = TypeVar("T")


def _omegaconf_error(
    err: Exception,
    source: str,
    key: str | None = None,
    schema: type | None = None,
    layer: DictConfig | None = None,
) -> ValueError:
    """OmegaConf's ``err`` as one line naming the key: an unknown key, or a schema key's bad
    value (the value ``layer`` gives it and what the key takes)."""
    key = key or getattr(err, "full_key", None) or "<root>"
    # OmegaConf appends its own "full_key / object_type" lines; the first line is the message,
    # whose placeholders it leaves unfilled when it raises without the node.
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    message = message.replace("Value '$VALUE' of type '$VALUE_TYPE'", "a value")
    expected = _expected(schema, key) if schema is not None else None
    if expected is None:
        if schema is not None and "Did you mean" not in message:  # OmegaConf's: a section's keys
            message += _suggestion(schema, key)
        return ValueError(f"invalid config key '{key}' ({source}): {message}")
    given = _given(layer, key)
    if given is None:  # no value to show: OmegaConf's own words say what is wrong with it
        return ValueError(f"bad value for config key '{key}' ({source}): {message}; {expected}")
    return ValueError(f"bad value for config key '{key}' ({source}): got {given}; {expected}")


def _given(layer: DictConfig | None, key: str) -> str | None:
    """The value ``layer`` gives ``key``, as written in YAML, or None when it gives none."""
    if layer is None:
        return None
    try:
        node = OmegaConf.select(layer, key, default=_ABSENT, throw_on_missing=False)
    except OmegaConfBaseException:
        return None
    if node is _ABSENT:
        return None
    value = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    return repr(value) if isinstance(value, str) else format_value(value)


_ABSENT = object()


def _expected(schema: type, key: str) -> str | None:
    """``"it takes <what> (<help>)"`` for a schema field, None for an unknown key."""
    found = _schema_field(schema, re.sub(r"\[\d+\]$", "", key))
    if found is None:
        return None
    hint, f = found
    help_text = f.metadata.get("help", "") if f is not None else ""
    return f"it takes {_describe_type(hint)}" + (f" ({help_text})" if help_text else "")


def _schema_field(schema: type, key: str) -> tuple[Any, dataclasses.Field | None] | None:
    """The resolved type hint and the field of the dotted ``key`` in ``schema``, or None."""
    hint: Any = schema
    f = None
    for name in key.split("."):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return None
        fields = {x.name: x for x in dataclasses.fields(hint)}
        if name not in fields:
            return None
        f, hint = fields[name], typing.get_type_hints(hint)[name]
    return hint, f


def _suggestion(schema: type, key: str) -> str:
    """``". Did you mean 'task.dataset.train_file'?"``: the schema's key closest to ``key``
    (an old key's new one), or ``""``."""
    renamed = renamed_keys(schema)
    leaves = [".".join((*path, f.name)) for path, section in _schema_sections(schema, ())
              for f in dataclasses.fields(section)]  # fmt: skip
    close = difflib.get_close_matches(key, [*leaves, *renamed], n=1, cutoff=0.8)
    return f". Did you mean '{renamed.get(close[0], close[0])}'?" if close else ""


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a float", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "floats", str: "strings"}


def _describe_type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not type(None)]
        text = " or ".join(_describe_type(a) for a in others)
        return f"{text} or null" if len(others) < len(args) else text
    if origin is dict:
        return "a mapping, written {key: value}, or one key at a time (key.name=value)"
    if origin is list:
        return f"a list of {_PLURALS.get(args[0], 'values') if args else 'values'}, written [a,b]"
    if origin is tuple and args and args[-1] is not Ellipsis:
        what = _PLURALS.get(args[0], "values") if len(set(args)) == 1 else "values"
        return f"{len(args)} {what}, written [a,b]"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return "a section: set its keys one by one (key.sub=value)"
    if isinstance(hint, type) and issubclass(hint, Enum):
        return "one of " + ", ".join(str(m.value) for m in hint)
    return _TYPE_NAMES.get(hint, "a value")


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(key path, value)`` of every leaf of a plain nested dict (a list is a leaf)."""
    if not isinstance(node, dict) or (prefix and not node):
        return [(prefix, node)]
    return [leaf for k, v in node.items() for leaf in _leaves(v, (*prefix, str(k)))]


def _nested(path: tuple[str, ...], value: Any) -> dict:
    for name in reversed(path):
        value = {name: value}
    return value


def _lists_from_scalars(schema: type, layer: DictConfig) -> DictConfig:
    """``layer`` with a single value given to a list key made a one-element list."""
    tree = OmegaConf.to_container(layer, resolve=False)
    changed = False
    for path, value in _leaves(tree):
        if value is None or isinstance(value, (list, dict)):
            continue
        found = _schema_field(schema, ".".join(path))
        if found is not None and typing.get_origin(found[0]) is list:
            node = tree
            for name in path[:-1]:
                node = node[name]
            node[path[-1]] = [value]
            changed = True
    return OmegaConf.create(tree) if changed else layer


def _renamed(schema: type, layer: DictConfig, source: str) -> DictConfig:
    """``layer`` with the old keys of ``schema``'s sections moved to their new names, and one
    ``FutureWarning`` listing them (old -> new)."""
    tree = OmegaConf.to_container(layer, resolve=False)
    moves = _move_old_keys(schema, tree, ())
    if not moves:
        return layer
    _warn_renamed(moves, source)
    return OmegaConf.create(tree)


def _warn_renamed(moves: list[tuple[str, str]], source: str) -> None:
    listed = ", ".join(f"{old} -> {new}" for old, new in moves)
    warnings.warn(
        f"renamed config keys ({source}), read under their new names until the next release: "
        f"{listed}",
        FutureWarning,
        stacklevel=3,
    )


def _override_layer(schema: type, overrides: Sequence[str]) -> DictConfig:
    """The ``key.sub=value`` overrides as one layer, each one's old keys moved to their new names
    first (an old ``task.rewards=[f]`` beside a new ``task.rewards.weights=[1]``), the later of
    two for one key winning."""
    tree: dict = {}
    moves: list[tuple[str, str]] = []
    for item in overrides:
        one = OmegaConf.to_container(_parse_overrides([item]), resolve=False)
        moves += _move_old_keys(schema, one, ())
        _merge_into(tree, one)
    if moves:
        _warn_renamed(moves, "command-line override")
    return OmegaConf.create(tree)


def _merge_into(tree: dict, layer: dict) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge_into(tree[key], value)
        else:
            tree[key] = value


def renamed_keys(schema: type) -> dict[str, str]:
    """``{old: new}`` full keys of every key ``schema``'s sections renamed or retired (an API key:
    its endpoint's ``api_key_env``), which :func:`load_config` still reads for one release."""
    out = {}
    for path, section in _schema_sections(schema, ()):
        prefix = "".join(f"{name}." for name in path)
        for old, new in getattr(section, "RENAMED_KEYS", {}).items():
            out[prefix + old] = prefix + new
        for old, endpoint in getattr(section, "SECRET_KEYS", {}).items():
            out[prefix + old] = f"{prefix}{endpoint}.api_key_env"
    return out


def _schema_sections(schema: type, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], type]]:
    hints = typing.get_type_hints(schema)
    out = [(path, schema)]
    for f in dataclasses.fields(schema):
        if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name]):
            out += _schema_sections(hints[f.name], (*path, f.name))
    return out


def _move_old_keys(schema: type, node: Any, path: tuple[str, ...]) -> list[tuple[str, str]]:
    """Move ``schema``'s old keys in the plain dict ``node`` (at ``path``) to their new places,
    its sections' too; ``(old, new)`` full keys of each move."""
    if not isinstance(node, dict):
        return []
    moves = []
    for old, new in getattr(schema, "RENAMED_KEYS", {}).items():
        # An old key the new section took the name of ("task.rewards" -> .functions) is the
        # section when it holds a mapping.
        if old in node and not (new.startswith(old + ".") and isinstance(node[old], dict)):
            _put(node, new.split("."), node.pop(old))
            moves.append((".".join((*path, old)), ".".join((*path, new))))
    for old, endpoint in getattr(schema, "SECRET_KEYS", {}).items():
        if old in node:
            moves.append(_move_secret(node, (*path, old), endpoint))
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and f.name in node:
            moves += _move_old_keys(hint, node[f.name], (*path, f.name))
    return moves


def _put(node: dict, names: list[str], value: Any) -> None:
    for name in names[:-1]:
        node = node.setdefault(name, {})
    node.setdefault(names[-1], value)  # the new key, given in the same layer, wins


def _move_secret(node: dict, path: tuple[str, ...], endpoint: str) -> tuple[str, str]:
    """An API key written in a config (``path``, retired): into the environment variable
    ``MICRORL_<PATH>`` of this process, which ``<endpoint>.api_key_env`` then names (an empty
    one is dropped); the key itself is never echoed nor saved."""
    value = node.pop(path[-1])
    new = ".".join((*path[:-1], endpoint, "api_key_env"))
    if value:
        variable = "MICRORL_" + "_".join(path).upper()
        os.environ[variable] = str(value)
        _put(node, [endpoint, "api_key_env"], variable)
        new += f" (the key given is read from ${variable} in this run: put it in an environment "
        new += "variable of your own and name it there)"
    return ".".join(path), new


def _merge(schema: type, cfg: DictConfig, layer: DictConfig, source: str) -> DictConfig:
    layer = _lists_from_scalars(schema, layer)
    try:
        return OmegaConf.merge(cfg, layer)
    # OmegaConf raises a bare TypeError for some container mismatches (a dict for a list).
    except (OmegaConfBaseException, TypeError) as err:
        key = getattr(err, "full_key", None)
        if not key:  # raised without its key (a tuple's length, a section given a value)
            key, err = _failing_leaf(schema, cfg, layer, err)
        raise _omegaconf_error(err, source, key, schema, layer) from None


def _failing_leaf(
    schema: type, cfg: DictConfig, layer: DictConfig, err: Exception
) -> tuple[str | None, Exception]:
    """The key of the first leaf of ``layer`` that fails to merge alone (the field it lies in,
    for a dict given to a list), and that merge's own error."""
    for path, value in _leaves(OmegaConf.to_container(layer, resolve=False)):
        try:
            OmegaConf.merge(cfg, OmegaConf.create(_nested(path, value)))
        except (OmegaConfBaseException, TypeError) as leaf_err:
            for n in range(1, len(path) + 1):
                found = _schema_field(schema, ".".join(path[:n]))
                if found is not None and not dataclasses.is_dataclass(found[0]):
                    path = path[:n]
                    break
            return ".".join(path), leaf_err
    return None, err


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
            layer = OmegaConf.load(path)
        except Exception as err:  # a YAML syntax error is not an OmegaConf error
            raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
        layers.append((f"file {path}", _renamed(schema, layer, f"file {path}")))
    layers.append(("command-line override", _override_layer(schema, overrides)))
    for source, layer in layers:
        cfg = _merge(schema, cfg, layer, source)
    return _instantiate(cfg)


def _instantiate(cfg: DictConfig) -> Any:
    # Build the sections bottom-up, so a range error raised by a nested dataclass's
    # __post_init__ (which knows only its own names, "optim.lr") is caught at the deepest section
    # that raises it, whose path completes the key ("actor.optim" + "optim.lr").
    built = None
    for path, section in _sections(cfg):  # the root last
        try:
            built = OmegaConf.to_object(section)
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, "values") from None
        except (ValueError, TypeError) as err:
            raise _range_error(err, path) from None
    return built


def _sections(node: DictConfig, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every dict node under ``node``, children before their parent (``node`` itself last)."""
    out = []
    for name in node:
        child = node[name]
        if OmegaConf.is_dict(child):
            out += _sections(child, (*path, str(name)))
    return [*out, (path, node)]


# "optim.lr must be >= 0, got -1" -> the key the message starts with is "optim.lr".
_LEADING_KEY = re.compile(r"^([A-Za-z_][\w.]*) must ")


def _range_error(err: Exception, section: tuple[str, ...]) -> ValueError:
    """The error of ``section``'s ``__post_init__``, naming the key by its full path: the key the
    message starts with, its first names overlapping the end of the section's path."""
    message = str(err)
    match = _LEADING_KEY.match(message)
    if match is None:
        where = f"section '{'.'.join(section)}'" if section else "config"
        return ValueError(f"invalid {where}: {message}")
    names = match.group(1).split(".")
    overlap = next(
        n
        for n in range(min(len(section), len(names)), -1, -1)
        if section[len(section) - n :] == tuple(names[:n])
    )
    key = ".".join([*section, *names[overlap:]])
    return ValueError(f"bad value for config key '{key}': {message}")


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

"""Deprecated: the out-of-process samplers moved to :mod:`microrl.rollout` (docs/changelog.md);
this re-export of its names goes in the next release."""

from __future__ import annotations

import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("microrl.rollout")
    if name not in module.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"microrl.remote is deprecated: import {name} from microrl.rollout",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(module, name)

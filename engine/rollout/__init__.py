"""Deprecated: rollouts moved to :mod:`microrl.rollout` (docs/changelog.md); this re-export of
its names goes in the next release. The engine itself never imports sampling."""

from __future__ import annotations

import importlib
import warnings


def __getattr__(name: str):
    module = importlib.import_module("microrl.rollout")
    if name not in module.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"microrl.engine.rollout is deprecated: import {name} from microrl.rollout (or microrl)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(module, name)

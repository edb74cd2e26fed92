"""Typed configuration for microrl engines and runs.

:mod:`~microrl.configs.engine` (the engines), :mod:`~microrl.configs.rollout` (the rollout
backends), :mod:`~microrl.configs.run` (a run's model, task, rollout, loop and output sections;
the task's own sections in :mod:`~microrl.configs.task`), :mod:`~microrl.configs.endpoint` (a
server of someone else's), :mod:`~microrl.configs.refusals` (what composes: every rule between
two sections), :mod:`~microrl.configs.fields` (a field with its ``--help`` text, a range check)
and :mod:`~microrl.configs.loader` (YAML, overrides, the old keys); :mod:`~microrl.configs.examples`
holds the examples' top-level configs, which the library never imports.
"""

from microrl.configs.engine import ActorConfig, CriticConfig, EngineConfig, LoraConfig, OptimConfig
from microrl.configs.loader import config_to_yaml, load_config
from microrl.losses.config import KLEstimator, PolicyLossConfig, PolicyLossType

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "EngineConfig",
    "KLEstimator",
    "LoraConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "PolicyLossType",
    "config_to_yaml",
    "load_config",
]

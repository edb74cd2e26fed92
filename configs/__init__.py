"""Typed configuration for microrl engines and examples."""

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

"""vLLM's own logs are quiet unless asked for (``rollout.vllm.verbose``); checked without starting
vLLM: the level is set by a function the backend calls before it imports vLLM."""

from __future__ import annotations

import logging
import os

import pytest

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.rollout.samplers import vllm as vllm_backend


@pytest.fixture
def vllm_logger(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "unset")  # put back as it was after the test
    monkeypatch.setattr(vllm_backend, "_USER_LOG_LEVEL", None)
    logger = logging.getLogger("vllm")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_vllm_logs_errors_only_unless_verbose(vllm_logger, monkeypatch) -> None:
    assert load_config(GRPOExampleConfig).rollout.vllm.verbose is False
    cfg = load_config(GRPOExampleConfig, None, ["rollout.vllm.verbose=true"])
    assert cfg.rollout.vllm.verbose is True
    assert vllm_backend.set_vllm_log_level(False) == "ERROR"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and vllm_logger.level == logging.ERROR
    assert vllm_backend.set_vllm_log_level(True) == "INFO"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and vllm_logger.level == logging.INFO
    # A level the user exported before starting the run wins.
    monkeypatch.setattr(vllm_backend, "_USER_LOG_LEVEL", "DEBUG")
    assert vllm_backend.set_vllm_log_level(False) == "DEBUG"
    assert vllm_logger.level == logging.DEBUG

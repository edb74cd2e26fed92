"""The ``task.judge`` section: an LLM judge asked for a score over an OpenAI-compatible endpoint.

The judge is on when ``url`` is set (:class:`microrl.tasks.judge.JudgeReward`, docs/tasks.md#llm-judges).
It is an :class:`~microrl.configs.endpoint.EndpointConfig` (``url``, ``api_key_env``) plus ``model``
with its grading settings: the API key is never a config value, the judge reads it from the
environment variable ``api_key_env`` names, so it reaches neither the command line nor a saved
config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from microrl.configs.endpoint import EndpointConfig
from microrl.configs.fields import config_field, require

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "JudgeConfig"]

#: The default grading prompt: ``{prompt}``, ``{response}`` and ``{answer}`` are the row's.
DEFAULT_JUDGE_TEMPLATE = (  # one line: --help shows it as a key=value row
    "Grade the response to the prompt from 0 (useless) to 10 (perfect). Prompt: {prompt} | "
    "Reference answer: {answer} | Response: {response} | Reply with the grade only."
)
_FIELDS = ("prompt", "response", "answer")


@dataclass
class JudgeConfig(EndpointConfig):
    """An LLM judge: each response is sent to ``url`` (``/chat/completions``) asking for
    ``model``, with ``template`` filled in, and the score is the first match of ``score_pattern``
    in the reply. Its ``url`` and ``api_key_env`` are an endpoint's, their help written for a
    judge; ``model`` is the judge's own (vLLM servers take none)."""

    url: str = config_field(
        "", "the judge's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (empty: off)"
    )
    api_key_env: str = config_field(
        "OPENAI_API_KEY",
        "the environment variable holding the server's API key (unset: no key is sent); the key "
        "itself never goes in a config",
    )
    model: str = config_field("", "the judge's model name, as its server calls it")
    template: str = config_field(
        DEFAULT_JUDGE_TEMPLATE,
        "the grading prompt (one user message); {prompt}, {response} and {answer} are filled in",
    )
    score_pattern: str = config_field(
        r"-?\d+(?:\.\d+)?",
        "regex: its first match in the reply is the score (a group, if it has one)",
    )
    max_tokens: int = config_field(16, "most tokens the judge may write per reply")
    temperature: float = config_field(0.0, "the judge's sampling temperature")
    max_concurrency: int = config_field(8, "most requests in flight at once (per process)")
    timeout_s: float = config_field(60.0, "seconds one request may take before it is retried")
    retries: int = config_field(
        2, "retries of a request that timed out, could not connect or got a 429/5xx answer"
    )
    backoff_s: float = config_field(
        0.5, "the wait before the first retry; doubled before each next one"
    )
    failure_score: float | None = config_field(
        None,
        "null: a failed request or unparsable reply stops the run naming the row; a number: "
        "that row's score instead, counted in judge/failures",
    )
    extra_body: dict[str, Any] = config_field(
        {},
        "extra request fields for the server, e.g. {structured_outputs: {regex: '[0-9]'}} on vLLM",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        self.check("task.judge")
        require(bool(self.model), "task.judge.model", "the model name, as the server calls it", "")
        try:
            self.template.format(**dict.fromkeys(_FIELDS, ""))
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                "task.judge.template must use only the fields {prompt}, {response} and {answer} "
                f"(braces doubled for a literal one): {type(err).__name__}: {err}"
            ) from None
        try:
            re.compile(self.score_pattern)
        except re.error as err:
            raise ValueError(f"task.judge.score_pattern is not a regex: {err}") from None
        for key in ("max_tokens", "max_concurrency"):
            value = getattr(self, key)
            require(isinstance(value, int) and value >= 1, f"task.judge.{key}", ">= 1", value)
        require(
            isinstance(self.retries, int) and self.retries >= 0,
            "task.judge.retries",
            "an int >= 0",
            self.retries,
        )
        require(self.timeout_s > 0, "task.judge.timeout_s", "> 0", self.timeout_s)
        require(self.backoff_s >= 0, "task.judge.backoff_s", ">= 0", self.backoff_s)
        require(self.temperature >= 0, "task.judge.temperature", ">= 0", self.temperature)
        if self.failure_score is not None:
            require(
                math.isfinite(self.failure_score),
                "task.judge.failure_score",
                "null or a finite float",
                self.failure_score,
            )

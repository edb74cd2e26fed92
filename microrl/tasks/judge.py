"""An LLM judge as a reward term: ``task.judge.url=...`` (docs/tasks.md#llm-judges).

Each response is sent to an OpenAI-compatible ``/chat/completions`` endpoint (a ``vllm serve``
judge, or any provider) as one user message, ``task.judge.template`` filled with the row's
``{prompt}``, ``{response}`` and ``{answer}``; the score is the first match of
``task.judge.score_pattern`` in the reply. The ``openai`` client sends the requests (its own
retries off: this module retries, so that each retry is counted), at most ``max_concurrency``
at once per process (a thread pool per call, a semaphore across calls), each with
``timeout_s``. A timeout, a connection error, a 429 or a
5xx answer is retried up to ``retries`` times, waiting ``backoff_s``, then twice that, and so
on; other errors (a wrong key: 401) are not. Replies are cached per (prompt, response), so a
repeated row (the held-out set at every evaluation) is asked once.

A row whose request failed or whose reply holds no score is a :class:`JudgeError` naming the
row, or, with ``failure_score`` set, gets that score and is counted in ``judge/failures``.
The API key is read from the environment variable ``api_key_env`` when the judge is built and
is never logged, stored in a config or put in an error message; without one, the requests carry
no ``Authorization`` header.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from microrl.configs.judge import JudgeConfig

__all__ = ["JudgeError", "JudgeReward", "parse_score"]

# The status codes worth asking again: rate limited, or a server error that may pass.
_RETRIED_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# The client insists on a key: its placeholder when the environment has none (never sent: the
# requests then omit the Authorization header).
_NO_KEY = "EMPTY"


class JudgeError(RuntimeError):
    """A row the judge could not score (a failed request, or a reply without a score)."""


def parse_score(reply: str, pattern: re.Pattern[str]) -> float | None:
    """The first match of ``pattern`` in ``reply`` (its first group, if it has one) as a
    float, or None when there is none or it is not a finite number."""
    found = pattern.search(reply or "")
    if found is None:
        return None
    text = found.group(1) if pattern.groups else found.group(0)
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


class JudgeReward:
    """``judge(completions, prompts, answers) -> list[float]``: a score per row from the judge.

    Args:
        config: the ``task.judge`` section (:class:`~microrl.configs.judge.JudgeConfig`).
        client: an ``openai.OpenAI``-like client (tests); None: one for ``config.url`` with the
            key from ``os.environ[config.api_key_env]``.
    """

    config_key = "task.judge"

    def __init__(self, config: JudgeConfig, client: Any = None) -> None:
        if not config.enabled:
            raise ValueError("task.judge.url must be set to use a judge")
        self.config = config
        self.pattern = re.compile(config.score_pattern)
        self.client, self._headers = (client, {}) if client is not None else _client(config)
        self._cache: dict[tuple[str, str], float | None] = {}
        self._lock = threading.Lock()
        # The bound holds across calls too (the held-out set scored while a rollout is).
        self._slots = threading.BoundedSemaphore(config.max_concurrency)
        self._stats = dict.fromkeys(
            ("judge/requests", "judge/retries", "judge/cache_hits", "judge/failures"), 0.0
        )

    def __repr__(self) -> str:  # never the client: it holds the key
        return f"JudgeReward(url={self.config.url!r}, model={self.config.model!r})"

    def __call__(
        self, completions: Sequence[str], prompts: Sequence[str], answers: Sequence[str]
    ) -> list[float]:
        rows = list(zip(prompts, completions, answers, strict=True))
        todo = {}  # (prompt, response) -> the answer to fill in, asked once per call
        with self._lock:
            for prompt, response, answer in rows:
                key = (prompt, response)
                if key in self._cache or key in todo:  # a repeat within the call is asked once
                    self._count("judge/cache_hits")
                else:
                    todo[key] = answer
        results: dict[tuple[str, str], tuple[float | None, str]] = {}
        if todo:
            workers = min(self.config.max_concurrency, len(todo))
            with ThreadPoolExecutor(workers, thread_name_prefix="microrl-judge") as pool:
                asked = {key: pool.submit(self._ask, *key, answer) for key, answer in todo.items()}
                results = {key: future.result() for key, future in asked.items()}
        scores = []
        for i, (prompt, response, _) in enumerate(rows):
            key = (prompt, response)
            with self._lock:
                cached = key in self._cache
                score = self._cache.get(key)
            problem = ""
            if not cached:
                score, problem = results[key]
                if score is not None:
                    with self._lock:
                        self._cache[key] = score
            if score is None:
                score = self._failed(i, problem or "no score", prompt, response)
            scores.append(score)
        return scores

    def _failed(self, row: int, problem: str, prompt: str, response: str) -> float:
        if self.config.failure_score is None:
            raise JudgeError(
                f"task.judge ({self.config.url}, model {self.config.model}) could not score row "
                f"{row} (prompt {_short(prompt)}, response {_short(response)}): {problem}; set "
                "task.judge.failure_score to score such rows instead (counted in judge/failures)"
            )
        with self._lock:
            self._count("judge/failures")
        return float(self.config.failure_score)

    def _ask(self, prompt: str, response: str, answer: str) -> tuple[float | None, str]:
        """One row's score (None and the problem when it failed), with retries."""
        cfg = self.config
        content = cfg.template.format(prompt=prompt, response=response, answer=answer)
        for attempt in range(cfg.retries + 1):
            if attempt:
                with self._lock:
                    self._count("judge/retries")
                time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
            with self._lock:
                self._count("judge/requests")
            try:
                with self._slots:
                    reply = self._request(content)
            except Exception as err:  # the client's errors: retried or given up on below
                problem = _describe(err)
                if _retried(err) and attempt < cfg.retries:
                    continue
                tries = f" after {attempt + 1} attempts" if attempt else ""
                return None, f"the request failed{tries}: {problem}"
            score = parse_score(reply, self.pattern)
            if score is None:
                return None, (
                    f"no score matching task.judge.score_pattern={cfg.score_pattern!r} in the "
                    f"reply {_short(reply)}"
                )
            return score, ""
        raise AssertionError("unreachable")  # the loop returns on its last attempt

    def _request(self, content: str) -> str:
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=cfg.model,
            messages=[{"role": "user", "content": content}],
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            timeout=cfg.timeout_s,
        )
        if cfg.extra_body:
            kwargs["extra_body"] = dict(cfg.extra_body)
        if self._headers:
            kwargs["extra_headers"] = self._headers
        completion = self.client.chat.completions.create(**kwargs)
        return completion.choices[0].message.content or ""

    def _count(self, name: str) -> None:
        self._stats[name] += 1.0  # under self._lock

    def drain_metrics(self) -> dict[str, float]:
        """Counts since the last call (summed over ranks by the recipe): ``judge/requests``
        (attempts sent), ``judge/retries``, ``judge/cache_hits`` and ``judge/failures``."""
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(self._stats, 0.0)
        return stats


def _client(config: JudgeConfig) -> tuple[Any, dict]:
    """The client of ``config.url``, and the headers each request adds (without a key in the
    environment: the Authorization header omitted, since the client wants a key)."""
    try:
        import openai
    except ImportError as err:
        raise ImportError(
            "task.judge needs the openai client: pip install 'microrl[judge]'"
        ) from err
    key = os.environ.get(config.api_key_env)
    client = openai.OpenAI(
        base_url=config.url, api_key=key or _NO_KEY, max_retries=0, timeout=config.timeout_s
    )
    return client, ({} if key else {"Authorization": openai.Omit()})


def _retried(err: Exception) -> bool:
    status = getattr(err, "status_code", None)
    if status is not None:
        return status in _RETRIED_STATUS
    name = type(err).__name__  # openai.APITimeoutError, APIConnectionError (no status code)
    return "Timeout" in name or "Connection" in name


def _describe(err: Exception) -> str:
    status = getattr(err, "status_code", None)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    head = f"{type(err).__name__}" + (f" (HTTP {status})" if status is not None else "")
    hint = ""
    if status in (401, 403):
        hint = " (check the key in the environment variable task.judge.api_key_env names)"
    return f"{head}: {text[:200]}{hint}"


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")

"""A minimal, authenticated JSON client for a ``vllm serve`` server: every request has a timeout,
a failure names the server, the route and its message (docs/async.md#vllm-servers)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "ServerAuthError",
    "ServerClient",
    "ServerDied",
    "ServerError",
    "exit_status",
    "resolve_api_key",
]

#: The environment variable vLLM's server reads its key from, and so does this client.
API_KEY_ENV = "VLLM_API_KEY"
# How long a broken request waits for a local server's exit code (sockets close a moment before).
_EXIT_WAIT_S = 3.0


class ServerError(RuntimeError):
    """A vLLM server failed a request, could not be reached, or sent something unreadable."""


class ServerAuthError(ServerError):
    """A vLLM server refused the API key (HTTP 401)."""


class ServerDied(ServerError):
    """A local vLLM server exited while a request waited for its answer."""


def resolve_api_key(api_key: str | None) -> tuple[str | None, str]:
    """The key to send and its source: ``api_key``, else ``$VLLM_API_KEY``, else none."""
    if api_key:
        return api_key, "the environment variable rollout.server.api_key_env names"
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV], f"the {API_KEY_ENV} environment variable"
    return None, "no key (the variable rollout.server.api_key_env names and VLLM_API_KEY are unset)"


class ServerClient:
    """JSON requests to one server.

    Args:
        url: the server's base URL (``http://host:port``).
        api_key: sent as a bearer token; None: ``$VLLM_API_KEY`` if set (:func:`resolve_api_key`).
        timeout_s: the longest wait for one answer.
        explain: what to add to an error's message (a local server's log tail), or None.
        exit_code: a local server's exit code within the given seconds (None while it runs);
            None for a server the user started.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 600.0,
        explain: Callable[[], str] | None = None,
        exit_code: Callable[[float], int | None] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self.api_key, self.key_source = resolve_api_key(api_key)
        self.timeout_s = float(timeout_s)
        self.explain = explain
        self.exit_code = exit_code

    def post(self, route: str, body: dict[str, Any] | None = None, **query: Any) -> Any:
        """POST ``body`` as JSON to ``route?query``; the decoded answer (or its plain text)."""
        return self._request("POST", route, body, query)

    def get(self, route: str) -> Any:
        return self._request("GET", route, None, {})

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now (no retry, a short timeout)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _request(self, method: str, route: str, body, query: dict[str, Any]) -> Any:
        url = f"{self.url}/{route.lstrip('/')}"
        if query:
            url += "?" + "&".join(f"{k}={_query_value(v)}" for k, v in query.items())
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            message = _error_message(err)
            if err.code == 401:
                raise ServerAuthError(
                    f"the vLLM server at {self.url} refused the API key ({self.key_source}) on "
                    f"/{route.lstrip('/')}: HTTP 401 {message}. Put the server's --api-key in the "
                    "environment variable rollout.server.api_key_env names (default "
                    f"{API_KEY_ENV})"
                ) from None
            raise ServerError(
                f"the vLLM server at {self.url} failed {method} /{route.lstrip('/')}: HTTP "
                f"{err.code} {message}{self._explained()}"
            ) from None
        except (OSError, urllib.error.URLError) as err:
            raise self._unanswered(f"{method} /{route.lstrip('/')}", err) from err
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:  # some routes answer in plain text (LoRA loading)
            return raw.decode(errors="replace")

    def _unanswered(self, request: str, err: Exception) -> ServerError:
        """The error of an unanswered request: the server died, timed out, or the connection."""
        reason = getattr(err, "reason", err)
        timed_out = isinstance(reason, TimeoutError)
        if self.exit_code is not None:
            code = self.exit_code(0.0 if timed_out else _EXIT_WAIT_S)
            if code is not None:
                return ServerDied(
                    f"the vLLM server at {self.url} died ({exit_status(code)}) during "
                    f"{request}{self._explained()}"
                )
        if timed_out:
            return ServerError(
                f"the vLLM server at {self.url} did not answer {request} within "
                f"{self.timeout_s:.0f} s{self._explained()}"
            )
        return ServerError(
            f"the vLLM server at {self.url} did not answer {request}: the connection failed "
            f"({type(reason).__name__}: {reason}){self._explained()}"
        )

    def _explained(self) -> str:
        return f"\n{self.explain()}" if self.explain is not None else ""


def exit_status(code: int) -> str:
    """``exit code 3``, or ``killed by SIGKILL (exit code -9)`` for a negative (signal) code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def _query_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _error_message(err: urllib.error.HTTPError) -> str:
    """The server's words from ``{"error": {"message"}}``, ``{"error"}`` or ``{"detail"}``."""
    try:
        raw = err.read()
        body = json.loads(raw)
    except Exception:  # not JSON (a proxy's page): its first bytes
        return repr(raw[:200]) if "raw" in locals() else err.reason
    error = body.get("error", body.get("detail", body)) if isinstance(body, dict) else body
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)

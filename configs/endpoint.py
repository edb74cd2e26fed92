"""One type for every external model endpoint: a URL and the API key's environment variable.

Rollout servers (``rollout.server``), a distillation teacher's server (``teacher.server``) and
the LLM judge (``task.judge``, which adds its model name and grading settings) are all reached
this way. The API
key is never a config value: ``api_key_env`` names the environment variable that holds it, so a
key reaches neither the command line, a saved config nor a log (docs/rollouts.md#endpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from microrl.configs.fields import config_field, require

__all__ = ["EndpointConfig"]


@dataclass
class EndpointConfig:
    """A server of someone else's: where it is and where its key is (vLLM servers take no model
    name: requests name the run's LoRA adapter, or none, the server's one model).

    Each owner checks it with :meth:`check` (its ``__post_init__`` cannot know the key's full
    path, ``rollout.server.url`` or ``task.judge.url``, nor whether several URLs are allowed).
    """

    url: str = config_field(
        "",
        "base URL of servers you started, http(s)://host:port (rollout.server: several, "
        "comma-separated); empty: microrl starts its own (docs/rollouts.md#endpoints)",
    )
    api_key_env: str = config_field(
        "",
        "the environment variable holding the server's API key (unset: no key is sent); the key "
        "itself never goes in a config",
    )

    @property
    def urls(self) -> list[str]:
        """The comma-separated ``url``'s entries, stripped (``[]`` when empty)."""
        return [u.strip() for u in self.url.split(",") if u.strip()]

    def api_key(self) -> str | None:
        """The key ``api_key_env`` names, read from the environment now (None: unset or empty)."""
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None

    def check(self, where: str, *, several: bool = False) -> None:
        """``ValueError`` naming ``<where>.<key>``: a URL that is not http(s) (one, unless
        ``several``), an ``api_key_env`` that is not a variable's name (the value is not echoed:
        it may be a key)."""
        urls = self.urls if several else [self.url] * bool(self.url)
        require(
            all(u.startswith(("http://", "https://")) for u in urls),
            f"{where}.url",
            "comma-separated http:// or https:// URLs" if several else "an http:// or https:// URL",
            self.url,
        )
        if self.api_key_env and not self.api_key_env.isidentifier():
            raise ValueError(
                f"{where}.api_key_env must name an environment variable (letters, digits, "
                "underscores); the key itself never goes in a config"
            )

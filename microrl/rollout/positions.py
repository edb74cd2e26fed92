"""The model's positions: a rollout row (prompt + response) must fit in them, checked before
sampling (past them GPT-2 fails deep in its embedding, a RoPE model runs on silently)."""

from __future__ import annotations

from typing import Any

__all__ = ["PositionLimit", "check_positions", "position_limit"]

#: ``(positions, attribute)``: the most positions a model takes and the config attribute saying so.
PositionLimit = tuple[int, str]
_ATTRIBUTES = ("n_positions", "max_position_embeddings")


def position_limit(config: Any) -> PositionLimit | None:
    """The positions of a transformers ``config`` (its text config's) and the attribute; or None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attribute in _ATTRIBUTES:
        value = getattr(text, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, attribute
    return None


def check_positions(
    prompt_tokens: int,
    max_new_tokens: int,
    limit: PositionLimit | None,
    *,
    what: str = "the longest prompt",
) -> None:
    """``ValueError`` when ``prompt_tokens + max_new_tokens`` run past ``limit`` (None: no check)."""
    if limit is None or prompt_tokens + max_new_tokens <= limit[0]:
        return
    positions, attribute = limit
    raise ValueError(
        f"{what} has {prompt_tokens} tokens: with rollout.max_new_tokens={max_new_tokens} a row "
        f"reaches {prompt_tokens + max_new_tokens} positions, past the model's {positions} "
        f"(config.{attribute}); lower rollout.max_new_tokens (for episodes, "
        "rollout.max_episode_tokens too) or shorten the prompts"
    )

"""Multi-turn episodes: the policy talks to an environment (skyrl-gym's :class:`TextEnv`).

A trajectory keeps the sampled token ids, never re-tokenized (re-encoding the decoded text can
give other ids, and the PPO ratio is then taken over tokens never sampled); only observations
are tokenized, as the chat template's delta after an assistant turn (:class:`ObservationRenderer`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict

from microrl.engine.moe.routes import NO_ROUTE, ROUTED_EXPERTS_KEY
from microrl.engine.parallel import distributed
from microrl.engine.vision import pad_images
from microrl.rollout.images import ImagePrompts
from microrl.rollout.layout import first_stop, rollout_batch
from microrl.rollout.turns import (
    PLAIN_CHAT_TEMPLATE,
    PROBE_CONVERSATION,
    chat_template_of,
    encode,
    render,
    template_turn_end,
)

__all__ = [
    "PLAIN_CHAT_TEMPLATE",
    "EpisodeError",
    "ObservationRenderer",
    "TextEnv",
    "Trajectory",
    "episode_batch",
    "play_episodes",
]


@runtime_checkable
class TextEnv(Protocol):
    """A text environment (skyrl-gym's ``BaseTextEnv`` API); ``close()`` is called if present.

    ``init(prompt)`` returns the model's first input (a text or chat messages) and metadata;
    ``step(action)`` gets the turn's text (special tokens removed) and returns
    ``{"observations": [messages], "reward": float | None, "done": bool}``.
    """

    def init(self, prompt: Any) -> tuple[Any, dict]: ...

    def step(self, action: str) -> Mapping[str, Any]: ...


class EpisodeError(RuntimeError):
    """An environment raised (or answered malformed output); names the row, call and turn."""


@dataclass
class Trajectory:
    """One row's episode so far: the ids after the prompt and what each of them is."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    model_token: list[bool] = field(default_factory=list)  # sampled (loss) or observation
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    truncated: bool = False
    failed: bool = False
    #: The first input's ``(pixel_values, image_grid_thw)`` and PIL images; None for text.
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    raw_images: list[Any] = field(default_factory=list)
    #: ``rollout.routing_replay``: the experts ``[n, L, k]`` of the first ``n`` tokens of
    #: ``prompt_ids + ids``, from the latest turn; None: not recorded.
    routes: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return not (self.done or self.truncated or self.failed)

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids.extend(ids)
        self.model_token.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


class ObservationRenderer:
    """Token ids of prompts and observations under the tokenizer's chat template: an observation
    is the ids after an assistant turn's end in ``[user, assistant, *observations]`` rendered for
    generation (a turn cut before its end gets the turn end too, ``with_eos``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template_of(tokenizer)
        end = template_turn_end(tokenizer)
        self.turn_end_id = end.token_id
        self._prefix = end.probe_ids  # the probe conversation up to its turn end

    def _ids(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        return encode(
            self.tokenizer, render(self.tokenizer, messages, generation_prompt=generation_prompt)
        )

    def prompt(self, first: Any) -> list[int]:
        """The ids of an episode's first input: a text, or chat messages rendered for generation."""
        if isinstance(first, str):
            return list(self.tokenizer(first)["input_ids"])
        return self._ids(_messages(first, "init()"), generation_prompt=True)

    def observation(self, messages: Any, *, with_eos: bool) -> list[int]:
        messages = _messages(messages, "step()['observations']")
        full = self._ids([*PROBE_CONVERSATION, *messages], generation_prompt=True)
        cut = len(self._prefix)
        if full[:cut] != self._prefix:
            raise ValueError(
                "the chat template renders the conversation before an observation differently "
                "once the observation is added; the observation's tokens cannot be isolated"
            )
        return full[cut - 1 :] if with_eos else full[cut:]


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"an environment's {where} must be a text or a list of chat messages")
    for message in value:
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise TypeError(
                f"an environment's {where} must hold chat messages {{'role', 'content'}}, "
                f"got {message!r}"
            )
    return [dict(m) for m in value]


def check_step_output(output: Any) -> tuple[list, float, bool]:
    """``(observations, reward, done)`` of a ``step()`` result, or a ``TypeError`` saying why not."""
    if not isinstance(output, Mapping) or "done" not in output:
        raise TypeError(
            "an environment's step() must return a mapping with 'observations', 'reward' and "
            f"'done' (skyrl-gym's BaseTextEnvStepOutput), got {type(output).__name__}"
        )
    reward = output.get("reward")
    if reward is not None and not isinstance(reward, int | float):
        raise TypeError(f"an environment's step()['reward'] must be a float, got {reward!r}")
    return list(output.get("observations") or []), float(reward or 0.0), bool(output["done"])


def episode_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> TensorDict:
    """The ``[B, T]`` rows ``[left-padded prompt | trajectory, right-padded]`` of finished
    episodes; ``loss_mask`` marks the sampled tokens only (observations are context),
    ``truncated`` ``[B]`` the episodes cut by ``max_turns`` or the token budget.
    """
    batch = rollout_batch(
        [t.prompt_ids for t in trajectories],
        [t.ids for t in trajectories],
        [t.logprobs for t in trajectories],
        [t.truncated for t in trajectories],
        pad_token_id,
        sampled=[t.model_token for t in trajectories],
    )
    if any(t.images is not None for t in trajectories):  # each row its prompt's images
        batch.update(pad_images([t.images for t in trajectories]))
    if any(t.routes is not None for t in trajectories):
        batch[ROUTED_EXPERTS_KEY] = _episode_routes(trajectories, batch["input_ids"].shape[1])
    return batch


def _episode_routes(trajectories: Sequence[Trajectory], width: int):
    """The rows' recorded routing ``[B, T, L, k]`` (-1 where a token has none)."""
    prompt_width = max(len(t.prompt_ids) for t in trajectories)
    like = next(t.routes for t in trajectories if t.routes is not None)
    out = like.new_full((len(trajectories), width, *like.shape[1:]), NO_ROUTE)
    for row, t in enumerate(trajectories):
        if t.routes is not None:
            start = prompt_width - len(t.prompt_ids)
            out[row, start : start + len(t.routes)] = t.routes
    return out


@dataclass
class _Row:
    index: int
    trajectory: Trajectory
    env: Any
    prompt_index: int


class _Player:
    """Runs the turns of a batch of episodes; one per :func:`play_episodes` call."""

    def __init__(self, backend, params, skip_env_errors: bool) -> None:
        self.backend, self.params, self.skip = backend, params, skip_env_errors
        self.renderer = ObservationRenderer(backend.tokenizer)
        self.stops = frozenset(backend.stop_token_ids)  # any of them ends a turn
        self.env_time, self.errors = 0.0, 0
        # Each prompt's images encoded once: its group's rows share one pixel-store entry.
        self.encoded: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def env_call(self, row: _Row, name: str, fn, *args, turn: int = 0):
        """``fn(*args)`` timed; a failure raises an :class:`EpisodeError`, or fails the row (None)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        except Exception as exc:  # any environment failure is reported the same way
            if not self.skip:
                trace = "".join(traceback.format_exception(exc)).rstrip()
                raise EpisodeError(
                    f"the environment of row {row.index} (prompt {row.prompt_index}) raised in "
                    f"{name}() at turn {turn}: {type(exc).__name__}: {exc}\nthe environment's "
                    f"traceback:\n{trace}"
                ) from exc
            self.fail(row)
            return None
        finally:
            self.env_time += time.perf_counter() - start

    def fail(self, row: _Row) -> None:
        self.errors += 1
        row.trajectory.failed = True

    def start(
        self,
        prompts: Sequence[Any],
        make_env: Callable[[int], Any],
        images: Sequence[Sequence[Any]] | None = None,
    ) -> list[_Row]:
        rows = []
        for prompt_index, prompt in enumerate(prompts):
            for _ in range(self.params.num_samples):
                row = _Row(len(rows), Trajectory(prompt_ids=[]), None, prompt_index)
                rows.append(row)
                row.env = self.env_call(row, "make_env", make_env, prompt_index)
                initial = (
                    None if row.env is None else self.env_call(row, "init", row.env.init, prompt)
                )
                if initial is None:
                    row.trajectory.failed = True
                    continue
                first = initial[0] if isinstance(initial, tuple) else initial
                row.trajectory.prompt_ids = self.renderer.prompt(first)
                if images is not None:  # placeholders expanded, encoded once per prompt
                    self.add_images(row.trajectory, images[prompt_index], prompt_index)
        return rows

    def add_images(self, trajectory: Trajectory, images: Sequence[Any], index: int) -> None:
        trajectory.prompt_ids, trajectory.images = self.backend.image_encoder.encode_ids(
            trajectory.prompt_ids, images, index, encoded=self.encoded.get(index)
        )
        self.encoded[index] = trajectory.images
        trajectory.raw_images = list(images)

    def turn(self, rows: list[_Row], number: int, max_turns: int, max_tokens: int) -> None:
        """One model turn of every active row and the environment's answer to it."""
        active = [r for r in rows if r.trajectory.active]
        if distributed.max_over_ranks(len(active)) == 0:  # no rank has an active episode
            return
        budgets = [max_tokens - len(r.trajectory.ids) for r in active]
        limit = min(self.params.max_new_tokens, max(budgets, default=1))
        seed = None if self.params.seed is None else self.params.seed + number - 1
        params = replace(self.params, num_samples=1, max_new_tokens=limit, seed=seed)
        # Under data parallelism every rank samples each turn (FSDP-sharded generation is a
        # collective); a rank whose episodes all ended samples a stand-in row it discards.
        contexts = [r.trajectory.prompt_ids + r.trajectory.ids for r in active]
        samples = self.sample(
            [r.trajectory for r in active] or [rows[0].trajectory],
            contexts or [rows[0].trajectory.prompt_ids or [0]],
            params,
        )
        if not active:
            return
        width = max(len(c) for c in contexts)
        for i, (row, budget, ids, logprobs) in enumerate(
            zip(active, budgets, samples.token_ids, samples.logprobs, strict=True)
        ):
            end = min(first_stop(ids, self.stops), budget)
            if samples.routed_experts is not None:  # this turn's context and response
                start = width - len(contexts[i])
                row.trajectory.routes = samples.routed_experts[i, start : width + end].clone()
            self.answer(row, ids[:end], logprobs[:end], number, max_turns, max_tokens)

    def sample(self, trajectories: list[Trajectory], contexts: list[list[int]], params):
        """The backend's samples of ``contexts``, with their images when any has some."""
        if all(t.images is None for t in trajectories):
            return self.backend._sample(contexts, params)
        prompts = ImagePrompts(
            ids=contexts,
            images=[t.images for t in trajectories],
            raw=[t.raw_images for t in trajectories],
        )
        return self.backend._sample_images(prompts, params)

    def answer(self, row: _Row, ids, logprobs, number: int, max_turns: int, max_tokens: int):
        trajectory = row.trajectory
        trajectory.add(ids, logprobs)
        trajectory.turns += 1
        text = self.backend.tokenizer.decode(ids, skip_special_tokens=True)
        output = self.env_call(row, "step", row.env.step, text, turn=number)
        if output is None:
            return
        try:
            observations, reward, done = check_step_output(output)
        except TypeError:
            if not self.skip:
                raise
            self.fail(row)
            return
        trajectory.reward += reward
        if done:
            trajectory.done = True
            return
        ended = bool(ids) and ids[-1] in self.stops
        observation = self.renderer.observation(observations, with_eos=not ended)
        # Cut before an observation that would leave no room for the next turn.
        if number == max_turns or len(trajectory.ids) + len(observation) >= max_tokens:
            trajectory.truncated = True
        else:
            trajectory.add(observation, None)

    def finish(self, rows: list[_Row]) -> tuple[list[Trajectory], list[int], dict[str, float]]:
        for row in rows:
            if callable(getattr(row.env, "close", None)):
                self.env_call(row, "close", row.env.close, turn=row.trajectory.turns)
        kept = [r for r in rows if not r.trajectory.failed]
        if not kept:
            raise EpisodeError(
                f"every one of the {len(rows)} episodes failed in its environment "
                "(rollout.skip_env_errors drops failed rows, but none is left)"
            )
        # Additive only (merged rollouts sum them); per-row turns and cuts are in the rollout.
        metrics = {"episodes/env_time_s": self.env_time, "episodes/env_errors": float(self.errors)}
        return [r.trajectory for r in kept], [r.prompt_index for r in kept], metrics


def play_episodes(
    backend,
    prompts: Sequence[Any],
    make_env: Callable[[int], Any],
    params,
    *,
    max_turns: int,
    max_tokens: int,
    skip_env_errors: bool = False,
    images: Sequence[Sequence[Any]] | None = None,
) -> tuple[list[Trajectory], list[int], dict[str, float]]:
    """Run ``params.num_samples`` episodes per prompt (:meth:`RolloutBackend.run_episodes`): the
    kept trajectories, the prompt each answers and the metrics."""
    player = _Player(backend, params, skip_env_errors)
    rows = player.start(prompts, make_env, images)
    for number in range(1, max_turns + 1):
        player.turn(rows, number, max_turns, max_tokens)
    for row in rows:  # still going after max_turns (no env said done): cut
        if row.trajectory.active:
            row.trajectory.truncated = True
    return player.finish(rows)

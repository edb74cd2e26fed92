"""What every rollout backend shares: the sampling parameters, the result, the batch layout.

A backend only turns prompt ids into sampled ids and log-probs (:meth:`RolloutBackend._sample`);
encoding, the cut at ``<eos>`` and the ``[B, T]`` layout are done here once, so two backends
given the same samples return identical batches (docs/rollouts.md).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tensordict import TensorDict

from microrl.engine.vision import pad_images
from microrl.rollout.episodes import Trajectory, episode_batch, play_episodes
from microrl.rollout.images import ImageEncoder, ImagePrompts, check_image_prompts
from microrl.rollout.layout import Samples, build_rollout
from microrl.rollout.turns import turn_terminators

__all__ = [
    "SEED_RANGE",
    "Rollout",
    "RolloutBackend",
    "Samples",
    "SamplingParams",
    "check_params",
    "check_tokenizer",
    "draw_seed",
    "encode_prompts",
]

#: Sampling seeds are in ``[0, SEED_RANGE)``: vLLM's int32 range.
SEED_RANGE = 2**31 - 1
#: Prompts: texts or token-id lists; each text prompt's PIL images, or None.
Prompts = Sequence[str] | Sequence[Sequence[int]]
Images = Sequence[Sequence[Any]] | None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: plain ancestral sampling at ``temperature`` unless asked otherwise.

    ``temperature`` must be the loss's (``ActorConfig.temperature``): sampling from anything
    else (top-k, top-p, another temperature) makes the first PPO ratio differ from 1.
    ``top_k=0`` and ``top_p=1.0`` mean off; ``greedy`` takes the argmax (evaluation), its
    log-probs still the tempered distribution's.
    """

    num_samples: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_samples", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SamplingParams.{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)):
            raise ValueError(
                f"SamplingParams.temperature must be a finite number, got {self.temperature!r}"
            )
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k must be an int >= 0 (0: off), got {self.top_k!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1: off), got {self.top_p!r}")


def check_params(params: Any) -> SamplingParams:
    """``params``, or a ``TypeError`` when it is not a :class:`SamplingParams`."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def draw_seed(params: SamplingParams) -> int:
    """A sampling call's seed: ``params.seed``, else drawn from torch's default generator, so a
    run that checkpoints torch's RNG state (``microrl.run.save_run``) draws the same seeds when
    resumed."""
    return params.seed if params.seed is not None else int(torch.randint(SEED_RANGE, ()))


@dataclass
class Rollout:
    """Sampled responses in the engine's token-aligned layout (docs/rollouts.md#the-result).

    ``batch`` ``[B, T]``: ``input_ids`` (left-padded prompt, response cut after its first
    ``stop_token_ids`` id, right-padded), ``attention_mask``, ``loss_mask`` (the response),
    ``rollout_logprobs`` (float32, 0 off the response), ``truncated`` ``[B]`` bool. ``texts``:
    responses decoded. ``group_ids`` ``[B]`` int64: the prompt a row answers (a GRPO group).
    Episodes add ``rewards`` ``[B]`` float32, ``num_turns`` ``[B]`` int64 and ``metrics``
    (sums, so merged rollouts add them up).
    """

    batch: TensorDict
    texts: list[str]
    group_ids: torch.Tensor
    rewards: torch.Tensor | None = None
    num_turns: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> Rollout:
        """This rollout with its tensors on ``device`` (backends build rollouts on the host;
        docs/batch.md#devices)."""
        moved = {
            name: value.to(device)
            for name, value in vars(self).items()
            if isinstance(value, torch.Tensor | TensorDict)  # rewards, num_turns: maybe None
        }
        return replace(self, **moved)


class RolloutBackend(ABC):
    """Samples responses to prompts from the current policy.

    Subclasses implement :meth:`_sample` (token ids in, :class:`Samples` out, stopping at
    ``stop_token_ids``) and, when they hold a copy of the weights, :meth:`sync`. Under
    ``torchrun`` every rank samples its own prompts (never the rows of one prompt).
    """

    #: Whether the backend samples a copy of the weights, loaded by :meth:`sync` (else the live
    #: model: nothing to load).
    holds_weights: bool = False

    def __init__(
        self, tokenizer, *, generation_config=None, image_encoder: ImageEncoder | None = None
    ) -> None:
        self.tokenizer = check_tokenizer(tokenizer)
        #: Encodes prompts with images (a vision-language policy's); None: text prompts only.
        self.image_encoder = image_encoder
        self.stop_token_ids: tuple[int, ...] = turn_terminators(
            tokenizer, generation_config, require_template=False
        )

    def generate(
        self, prompts: Prompts, params: SamplingParams, *, images: Images = None
    ) -> Rollout:
        """Sample ``params.num_samples`` responses per prompt; rows are grouped by prompt.

        ``prompts``: texts (with the tokenizer's special tokens; apply a chat template first,
        :func:`microrl.tasks.format_prompt`) or token-id lists. ``images[i]``: text prompt
        ``i``'s PIL images, one per placeholder (docs/batch.md#images).
        """
        check_params(params)
        encoded = None
        if images is None:
            prompt_ids = encode_prompts(self.tokenizer, prompts)
            samples = self._sample(prompt_ids, params)
        else:
            check_image_prompts(self, prompts, images)
            encoded = self.image_encoder.encode(self.tokenizer, prompts, images)
            prompt_ids = encoded.ids
            samples = self._sample_images(encoded, params)
        batch = build_rollout(
            prompt_ids,
            samples,
            num_samples=params.num_samples,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        if encoded is not None and any(row is not None for row in encoded.images):
            per_row = [encoded.images[i // params.num_samples] for i in range(len(batch))]
            batch.update(pad_images(per_row))
        response = torch.where(batch["loss_mask"], batch["input_ids"], self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode(response, skip_special_tokens=True)
        group_ids = torch.arange(len(prompt_ids)).repeat_interleave(params.num_samples)
        return Rollout(batch=batch, texts=texts, group_ids=group_ids)

    def run_episodes(
        self,
        prompts: Sequence[Any],
        make_env: Callable[[int], Any],
        params: SamplingParams,
        *,
        max_turns: int,
        max_tokens: int,
        skip_env_errors: bool = False,
        images: Images = None,
    ) -> Rollout:
        """Play ``params.num_samples`` multi-turn episodes per prompt, each against a fresh
        ``make_env(i)`` for ``prompts[i]`` (docs/rollouts.md#multi-turn-episodes).

        An episode ends at ``done``, or ``truncated`` after ``max_turns`` turns or ``max_tokens``
        tokens. An environment that raises is an :class:`~microrl.rollout.episodes.EpisodeError`
        (``skip_env_errors``: its row dropped). Collective under ``torchrun``. ``images[i]``:
        the PIL images of the first input ``init`` returns for prompt ``i``.
        """
        check_params(params)
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list (texts or chat messages)")
        if not callable(make_env):
            raise TypeError(f"make_env must be callable (index -> env), got {make_env!r}")
        for name, value in (("max_turns", max_turns), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if images is not None:
            check_image_prompts(self, prompts, images)
        trajectories, group_ids, metrics = play_episodes(
            self,
            prompts,
            make_env,
            params,
            max_turns=max_turns,
            max_tokens=max_tokens,
            skip_env_errors=skip_env_errors,
            images=images,
        )
        return episode_rollout(self.tokenizer, trajectories, group_ids, metrics)

    def sync(self, engine) -> None:  # noqa: B027 - a backend that reads the live model has none
        """Load ``engine``'s current weights into the backend (after optimizer steps)."""

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the backend holds (worker processes, memory)."""

    @abstractmethod
    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples: ...

    def _sample_images(self, prompts: ImagePrompts, params: SamplingParams) -> Samples:
        """Like :meth:`_sample`, for prompts with images (``prompts.ids`` placeholders expanded)."""
        raise ValueError(f"the {type(self).__name__} rollout backend does not sample image prompts")


def episode_rollout(
    tokenizer,
    trajectories: Sequence[Trajectory],
    group_ids: Sequence[int],
    metrics: dict[str, float],
    rewards: Sequence[float] | None = None,
) -> Rollout:
    """The rollout of finished episodes (:func:`~microrl.rollout.episodes.episode_batch`), row
    ``i`` answering prompt ``group_ids[i]``; ``rewards`` (None: the trajectories' own)."""
    return Rollout(
        batch=episode_batch(trajectories, tokenizer.pad_token_id),
        texts=[tokenizer.decode(t.ids, skip_special_tokens=False) for t in trajectories],
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        rewards=torch.tensor(
            [t.reward for t in trajectories] if rewards is None else rewards, dtype=torch.float32
        ),
        num_turns=torch.tensor([t.turns for t in trajectories], dtype=torch.long),
        metrics=metrics,
    )


def check_tokenizer(tokenizer):
    """``tokenizer``, checked to have what a rollout needs: rows are cut at ``<eos>`` and padded."""
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(f"the tokenizer needs a {name} (rollouts cut at <eos> and pad)")
    return tokenizer


def encode_prompts(tokenizer, prompts: Prompts) -> list[list[int]]:
    """Token ids of ``prompts``: texts (with the tokenizer's special tokens) or id lists; a
    prompt of no token (an empty text, with a tokenizer that adds no BOS) is a ``ValueError``."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of texts or of token-id lists")
    if all(isinstance(p, str) for p in prompts):
        encoded = [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]
        for i, ids in enumerate(encoded):
            if not ids:  # a response at a row's first position: nothing predicts its token
                raise ValueError(
                    f"prompt {i} ({prompts[i]!r:.60}) encodes to no token (the tokenizer adds "
                    "no BOS): every prompt needs at least one token before its response"
                )
        return encoded
    if any(isinstance(p, str) or not all(isinstance(t, int) for t in p) or not p for p in prompts):
        raise ValueError("prompts must be all texts or all non-empty token-id lists, not a mix")
    return [list(p) for p in prompts]

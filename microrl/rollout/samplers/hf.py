"""The ``hf`` rollout backend: transformers ``generate`` on the engine's own model.

No extra dependency and no second copy of the weights: it samples from the model the engine
trains (gathered when FSDP2 shards it), so there is nothing to sync. Slow next to vLLM (no paged
attention, no continuous batching), which is why the ``vllm`` backend exists (docs/rollouts.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from microrl.engine import setup
from microrl.engine.base import Engine
from microrl.engine.moe import RoutingRecorder
from microrl.engine.parallel import distributed
from microrl.engine.parallel.distributed import gathered
from microrl.rollout.base import RolloutBackend, Samples, SamplingParams
from microrl.rollout.images import ImageEncoder, ImagePrompts
from microrl.rollout.positions import check_positions, position_limit

__all__ = ["HFRollout", "engine_autocast_dtype", "routing_recorder", "seeded"]


class _LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(scores / T)`` at each sampled token, one step late: a processor
    runs before transformers' temperature warper and sees the drawn token only at the next step
    (one step's ``[B, V]`` kept, not ``output_scores``' ``[steps, B, V]``)."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _gather(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, tokens[:, None]).squeeze(1).cpu())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._gather(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        self._gather(last_tokens)
        self.previous = None
        return torch.stack(self.steps, dim=1)  # [B, steps]


class _BanTokens(LogitsProcessor):
    """Never samples ``token_ids`` (an image placeholder, which the engine refuses in a
    response); after :class:`_LogprobRecorder`, so the recorded log-probs are not truncated."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token_ids] = -float("inf")
        return scores


def routing_recorder(model: nn.Module) -> RoutingRecorder:
    """A :class:`RoutingRecorder` on ``model``'s routers; ``ValueError`` naming
    ``rollout.routing_replay`` for a model without mixture-of-experts routers."""
    try:
        return RoutingRecorder(model)
    except ValueError as error:
        raise ValueError(
            f"rollout.routing_replay=true records the experts of a mixture-of-experts policy: "
            f"{error} (set rollout.routing_replay=false for a dense model)"
        ) from error


def engine_autocast_dtype(engine: Engine) -> torch.dtype | None:
    """The dtype ``engine``'s forwards autocast to (None: none): what a sampler of its policy
    runs under to sample at the trainer's precision."""
    context = setup.autocast_context(engine.config, engine.device)
    return context.fast_dtype if isinstance(context, torch.autocast) else None


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """Autocast to ``dtype`` on ``device``'s type (None: a no-op context)."""
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


@contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the block on the CPU (and CUDA ``device``'s) generator seeded with ``seed`` (None:
    unchanged), the caller's restored after it (``torch.random.fork_rng``)."""
    if seed is None:
        yield
        return
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        for each in cuda:
            with torch.cuda.device(each):
                torch.cuda.manual_seed(seed)
        yield


class HFRollout(RolloutBackend):
    """Samples with ``model.generate`` from the engine's live model (or any causal LM).

    Args:
        engine: an :class:`~microrl.engine.ActorEngine` (its ``module`` gathered under FSDP2),
            or a transformers causal LM.
        autocast_dtype: for a bare causal LM, what ``generate`` autocasts to (None: none); an
            engine samples under its own autocast, the distribution it trains.
        image_encoder: a vision-language policy's, for image prompts (docs/rollouts.md#images).
        record_routing: rows carry ``routed_experts`` ``[B, T, L, k]``
            (``rollout.routing_replay``); a model without routers is a ``ValueError``.

    Under data parallelism ``generate`` runs with ``synced_gpus=True`` (sharded weights need
    every rank to run the same forwards); ``rollout_logprobs`` are float32
    ``log_softmax(logits / temperature)``, which top-k/top-p do not truncate. A text batch past
    the model's positions is a ``ValueError`` before any forward.
    """

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        autocast_dtype: torch.dtype | None = None,
        image_encoder: ImageEncoder | None = None,
        record_routing: bool = False,
    ) -> None:
        is_engine = isinstance(engine, Engine)
        model = engine.model if is_engine else engine
        if not isinstance(model, nn.Module) or not hasattr(model, "generate"):
            raise TypeError(
                f"engine must be an engine or a transformers causal LM, got {type(engine).__name__}"
            )
        super().__init__(
            tokenizer,
            generation_config=getattr(model, "generation_config", None),
            image_encoder=image_encoder,
        )
        if is_engine and autocast_dtype is not None:
            raise ValueError(
                "autocast_dtype is for a bare causal LM: an engine samples at its own precision "
                "(its config's dtype)"
            )
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast_dtype must be None, bfloat16 or float16, got {autocast_dtype}"
            )
        self.model = model
        self._gather_root = engine.module if is_engine else model
        # The engine's compute device: under optim.cpu_offload its parameters live on the host.
        self._device = engine.device if is_engine else None
        #: The autocast dtype ``generate`` runs under: the engine's, else ``autocast_dtype``.
        self.autocast_dtype = engine_autocast_dtype(engine) if is_engine else autocast_dtype
        #: The model's positions (None: its config states none): a row past them is refused.
        self.position_limit = position_limit(getattr(model, "config", None))
        #: Records the routers' choices around ``generate`` (None: not asked).
        self.recorder = routing_recorder(model) if record_routing else None

    def _sample_images(self, prompts: ImagePrompts, params: SamplingParams) -> Samples:
        """Image prompts in one batch: the rows' patches and grids concatenated in row order."""
        rows = [img for img in prompts.images for _ in range(params.num_samples)]
        present = [img for img in rows if img is not None]
        if not present:
            return self._sample(prompts.ids, params)
        pixels = torch.cat([pixels for pixels, _ in present])
        return self._sample(prompts.ids, params, (pixels, torch.cat([g for _, g in present])))

    @torch.no_grad()
    def _sample(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Samples:
        """``params.num_samples`` rows per prompt; ``images``: every row's patches and grids."""
        device = self._device or next(self.model.parameters()).device
        width = max(len(p) for p in prompt_ids)
        if images is None:  # an image's tokens take fewer (mRoPE) positions than their count
            check_positions(width, params.max_new_tokens, self.position_limit)
        pad = self.tokenizer.pad_token_id
        rows = [p for p in prompt_ids for _ in range(params.num_samples)]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
        # Plain sampling: top-k / top-p off unless asked (an unset top_k falls back to
        # transformers' default of 50, a truncated distribution the loss does not score).
        sampling: dict[str, Any] = {"do_sample": not params.greedy}
        if not params.greedy:
            sampling.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=list(self.stop_token_ids),  # stops at any turn terminator
            pad_token_id=pad,
            bos_token_id=self.tokenizer.bos_token_id,
            **sampling,
        )
        recorder = _LogprobRecorder(params.temperature)
        processors: list[LogitsProcessor] = [recorder]
        if self.image_encoder is not None:  # a vision-language policy: no placeholder sampled
            processors.append(_BanTokens([self.image_encoder.image_token_id]))
        vision: dict[str, torch.Tensor] = {}
        if images is not None:
            placeholders = (ids == self.image_encoder.image_token_id) & mask.bool()
            vision = {
                "pixel_values": images[0].to(device),
                "image_grid_thw": images[1].to(device),
                "mm_token_type_ids": placeholders.int(),  # the model's mRoPE positions read it
            }
        was_training = self.model.training
        self.model.eval()
        try:
            with (
                gathered(self._gather_root),
                seeded(params.seed, device),
                autocast(device, self.autocast_dtype),
                self.recorder or nullcontext(),
            ):
                sequences = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList(processors),
                    synced_gpus=distributed.is_distributed(),
                    **vision,
                )
        finally:
            self.model.train(was_training)
        response = sequences[:, width:]
        logprobs = recorder.finish(response[:, -1])
        routes = None
        if self.recorder is not None:  # [B, width + steps, L, k]; the layout masks past stops
            routes = self.recorder.routes(len(ids), sequences.shape[1])
            self.recorder.clear()
        return Samples(
            token_ids=response.cpu().tolist(), logprobs=logprobs.tolist(), routed_experts=routes
        )

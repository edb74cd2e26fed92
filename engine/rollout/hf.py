"""The ``hf`` rollout backend: transformers ``generate`` on the engine's own model.

No extra dependency and no second copy of the weights: it samples from the model the engine
trains (gathered when FSDP2 shards it), so there is nothing to sync. Slow next to vLLM (no paged
attention, no continuous batching), which is why the ``vllm`` backend exists (docs/rollouts.md).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from microrl.engine.base import Engine
from microrl.engine.parallel import distributed
from microrl.engine.parallel.distributed import gathered
from microrl.engine.rollout.base import RolloutBackend, Samples, SamplingParams

__all__ = ["HFRollout"]


class _LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(scores / T)`` at each sampled token, one step late.

    transformers applies a user's logits processors *before* its temperature warper, and a
    processor does not see the token drawn from its scores, only, at the next step, ``input_ids``
    with that token appended. So each call gathers the previous step's log-probs at the newest
    token and keeps its own ``[B, V]`` log-probs for the next call (one step's worth of memory,
    not ``output_scores``' ``[steps, B, V]``); :meth:`finish` gathers the last step's.
    """

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


class HFRollout(RolloutBackend):
    """Samples with ``model.generate`` from the engine's live model (or any causal LM).

    Args:
        engine: an :class:`~microrl.engine.ActorEngine` (its ``model`` is sampled, its ``module``
            gathered under FSDP2), or a transformers causal LM.
        tokenizer: its tokenizer (``eos_token_id`` and ``pad_token_id`` set).

    Under data parallelism ``generate`` runs with ``synced_gpus=True``: a rank whose rows all ended
    keeps stepping until every rank is done, so all ranks run the same number of forwards, which
    sharded (FSDP2) weights need. ``rollout_logprobs`` are ``log_softmax(logits / temperature)``
    at the sampled tokens, computed in float32 by the model's own forward (top-k/top-p, when asked
    for, truncate the sampling but not these log-probs).
    """

    def __init__(self, engine, tokenizer) -> None:
        super().__init__(tokenizer)
        model = engine.model if isinstance(engine, Engine) else engine
        if not isinstance(model, nn.Module) or not hasattr(model, "generate"):
            raise TypeError(
                f"engine must be an engine or a transformers causal LM, got {type(engine).__name__}"
            )
        self.model = model
        self._gather_root = engine.module if isinstance(engine, Engine) else model
        # The engine's compute device: under optim.cpu_offload its parameters live on the host.
        self._device = engine.device if isinstance(engine, Engine) else None

    @torch.no_grad()
    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        device = self._device or next(self.model.parameters()).device
        width = max(len(p) for p in prompt_ids)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device
        )
        ids = ids.repeat_interleave(params.num_samples, dim=0)
        mask = mask.repeat_interleave(params.num_samples, dim=0)
        # Plain sampling: top-k / top-p off unless asked (an unset top_k falls back to
        # transformers' default of 50, a truncated distribution the loss does not score).
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {
                "do_sample": True,
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
            }
        )
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=pad,
            bos_token_id=self.tokenizer.bos_token_id,
            **sampling,
        )
        recorder = _LogprobRecorder(params.temperature)
        generator_state = None
        if params.seed is not None:
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            with gathered(self._gather_root):
                sequences = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=config,
                    logits_processor=LogitsProcessorList([recorder]),
                    synced_gpus=distributed.is_distributed(),
                )
        finally:
            self.model.train(was_training)
            if generator_state is not None:
                torch.random.set_rng_state(generator_state)
        response = sequences[:, width:]
        logprobs = recorder.finish(response[:, -1])
        return Samples(token_ids=response.cpu().tolist(), logprobs=logprobs.tolist())

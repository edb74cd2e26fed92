"""Sampling responses and laying them out as engine batches (docs/batch.md).

A rollout row is ``[left-padded prompt | response, right-padded after its <eos>]``: ``input_ids``,
``attention_mask`` and ``loss_mask`` ``[B, T]``, the loss mask on the response tokens up to and
including the first ``<eos>``. That is exactly the token-aligned layout the engine scores, so the
log-probs the engine computes refer to the very tokens that were sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import GenerationConfig, PreTrainedTokenizerBase

from common.runtime import Dist
from common.task import AdditionTask, Problem

__all__ = ["Rollout", "evaluate_accuracy", "generate", "sft_batch"]


@dataclass
class Rollout:
    batch: TensorDict  # [B, T]: input_ids, attention_mask, loss_mask
    responses: list[str]  # decoded response text of each row, special tokens removed
    prompt_index: torch.Tensor  # [B] int64: which prompt each row answers (group id for GRPO)


def _encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    if tokenizer.padding_side != "left":
        raise ValueError("generation needs a left-padding tokenizer (tokenizer.padding_side)")
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    num_samples: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 4,
    greedy: bool = False,
) -> Rollout:
    """Sample ``num_samples`` responses per prompt (rows grouped by prompt) in eval mode.

    Sampling is plain ancestral sampling from ``softmax(logits / temperature)`` (no top-k/top-p),
    the distribution the loss scores at the same temperature, so the first PPO ratio is 1.

    Under data parallelism (``torch.distributed`` initialised, more than one rank) ``generate``
    runs with ``synced_gpus=True``: a rank whose rows all ended keeps stepping until every rank
    is done, so all ranks run the same number of forwards, which sharded (FSDP) weights need.
    Each response is cut after its first ``<eos>``; what follows is padding.
    """
    if not prompts:
        raise ValueError("prompts must not be empty")
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_samples and max_new_tokens must be >= 1, got {num_samples}, {max_new_tokens}"
        )
    prompt_ids, prompt_mask = _encode_prompts(tokenizer, prompts)
    device = next(model.parameters()).device
    prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0).to(device)
    prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0).to(device)
    # Plain sampling: top-k / top-p explicitly off (an unset top_k falls back to transformers'
    # default of 50, sampling from a truncated distribution the loss does not score).
    sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **sampling,
    )
    was_training = model.training
    model.eval()
    try:
        sequences = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=gen_config,
            synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
        )
    finally:
        model.train(was_training)
    response = sequences[:, prompt_ids.shape[1] :].cpu()
    # Keep the response up to and including its first <eos>; everything after is padding.
    is_eos = response == tokenizer.eos_token_id
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    response_mask = ~after_eos
    response = torch.where(response_mask, response, tokenizer.pad_token_id)
    batch = TensorDict(
        {
            "input_ids": torch.cat([prompt_ids.cpu(), response], dim=1),
            "attention_mask": torch.cat([prompt_mask.cpu().bool(), response_mask], dim=1),
            "loss_mask": torch.cat(
                [torch.zeros_like(prompt_mask, dtype=torch.bool).cpu(), response_mask], dim=1
            ),
        },
        batch_size=[response.shape[0]],
    )
    texts = tokenizer.batch_decode(response, skip_special_tokens=True)
    index = torch.arange(len(prompts)).repeat_interleave(num_samples)
    return Rollout(batch=batch, responses=texts, prompt_index=index)


def sft_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], answers: Sequence[str]
) -> TensorDict:
    """Teacher-forcing rows ``prompt + answer + <eos>``, loss on ``answer + <eos>`` (``[B, T]``)."""
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(
            f"need as many answers as prompts (>0), got {len(prompts)}, {len(answers)}"
        )
    rows, masks = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    # Right padding here: the engine takes any padding, and nothing is generated from these rows.
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor(
        [[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool
    )
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    return TensorDict(
        {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask},
        batch_size=[len(rows)],
    )


def evaluate_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    problems: Sequence[Problem],
    dist_info: Dist,
    max_new_tokens: int,
) -> float:
    """Greedy exact-match accuracy over every rank's share of ``problems`` (summed over ranks)."""
    rollout = generate(
        model, tokenizer, [p.prompt for p in problems], greedy=True, max_new_tokens=max_new_tokens
    )
    correct, total = dist_info.sum([sum(task.score(rollout.responses, problems)), len(problems)])
    return correct / max(total, 1.0)

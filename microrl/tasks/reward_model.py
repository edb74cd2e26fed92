"""A scalar reward model as a reward term: ``task.reward_model=path`` (docs/tasks.md#reward-models).

The model is a transformers sequence-classification checkpoint with one label (what
``export_merged_model`` writes for a trained :class:`~microrl.engine.RewardModelEngine`, or any
``*ForSequenceClassification`` on the Hub), or a ``RewardModelEngine`` checkpoint
(``engine.save_checkpoint``) with the base model it was trained from (``task.reward_model_base``:
:mod:`~microrl.engine.checkpoint.reward_model`), loaded in float32, frozen, on this process's
device. Each row is scored as text with the reward model's **own** tokenizer: ``prompt +
completion`` (the prompt as the policy saw it, after any chat template), or, with
``chat_template``, the reward model's chat template over a user turn (the prompt) and an
assistant turn (the completion). Text, not the sampled ids, because a reward model's vocabulary
is in general not the policy's. Rows are scored ``batch_size`` at a time, right-padded: a
classifier pools its last non-pad token.

``norm``: ``none`` (raw scores), ``batch`` (standardised over the rows of one call: this
process's rollout) or ``group`` (standardised over the rows of one prompt). Thread-safe: the
recipes may score in a background thread (docs/async.md) while evaluating in the main one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["NORMS", "RewardModelScorer", "normalise"]

NORMS = ("none", "batch", "group")
# Standardising a set of equal scores divides 0 by 0: the std is floored at this.
_STD_FLOOR = 1e-6


def normalise(scores: torch.Tensor, norm: str, groups: Sequence[object]) -> torch.Tensor:
    """``scores`` ``[B]`` float64 standardised as ``norm`` says: ``(s - mean) / max(std,
    1e-6)`` over all rows (``batch``) or over the rows of equal ``groups`` keys (``group``; a
    group of one row gets 0); ``none`` returns them unchanged. The std is the population one."""
    if norm == "none" or len(scores) == 0:
        return scores
    if norm == "batch":
        return (scores - scores.mean()) / scores.std(unbiased=False).clamp_min(_STD_FLOOR)
    if norm != "group":
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    out = torch.empty_like(scores)
    index: dict[object, list[int]] = {}
    for i, key in enumerate(groups):
        index.setdefault(key, []).append(i)
    for rows in index.values():
        part = scores[rows]
        out[rows] = (part - part.mean()) / part.std(unbiased=False).clamp_min(_STD_FLOOR)
    return out


class RewardModelScorer:
    """``scorer(completions, prompts) -> list[float]``: the reward model's score of each row.

    Args:
        path: a local sequence-classification checkpoint (with its tokenizer), a Hub id, or a
            ``RewardModelEngine`` checkpoint directory (then ``base`` is needed).
        base: the base model an engine checkpoint was trained from (its tokenizer is used).
        batch_size: rows per forward.
        norm: ``none``, ``batch`` or ``group`` (module docstring).
        chat_template: render rows with the reward model's chat template.
        device: where the model runs; None: this process's current GPU when CUDA is
            available (the run sets it before it builds the task), else the CPU. Chosen here,
            in the caller's thread: a background thread's current GPU is always the first.
        model, tokenizer: an already loaded model and tokenizer instead of ``path``'s.

    Raises ``ValueError`` naming ``task.reward_model``: a path that holds no sequence
    classifier, a classifier with more than one label, a tokenizer with neither pad nor EOS
    token, or ``chat_template`` without a template; naming ``task.reward_model_base``: an
    engine checkpoint without it, a base that does not fit the checkpoint, or a base given for
    a path that is not an engine checkpoint.
    """

    config_key = "task.reward_model"

    def __init__(
        self,
        path: str | None = None,
        *,
        base: str | None = None,
        batch_size: int = 8,
        norm: str = "none",
        chat_template: bool = False,
        device: str | torch.device | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        if norm not in NORMS:
            raise ValueError(f"task.reward_model_norm must be one of {', '.join(NORMS)}: {norm!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"task.reward_model_batch_size must be an int >= 1: {batch_size!r}")
        self.path = str(path) if path is not None else getattr(model, "name_or_path", "?")
        if model is None or tokenizer is None:
            model, tokenizer = _load(self.path, base)
        self.device = torch.device(device) if device is not None else _default_device()
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.norm = norm
        self.chat_template = chat_template
        self._lock = threading.Lock()
        self._check()
        self._stats = {"reward_model/rows": 0.0, "reward_model/score_sum": 0.0}

    def __repr__(self) -> str:
        return f"RewardModelScorer({self.path!r}, norm={self.norm!r})"

    def _check(self) -> None:
        where = f"task.reward_model={self.path!r}"
        labels = getattr(self.model.config, "num_labels", None)
        if labels != 1:
            raise ValueError(f"{where} has {labels} labels; a scalar reward model has 1")
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"{where}: its tokenizer has neither a pad nor an EOS token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        # The classifier pools the last token that is not its config's pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"task.reward_model_chat_template=true, but {where}'s tokenizer has no chat "
                "template"
            )

    def texts(self, completions: Sequence[str], prompts: Sequence[str]) -> list[str]:
        """The text the reward model reads for each row."""
        if not self.chat_template:
            return [p + c for p, c in zip(prompts, completions, strict=True)]
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                tokenize=False,
            )
            for p, c in zip(prompts, completions, strict=True)
        ]

    @torch.no_grad()
    def raw_scores(self, texts: Sequence[str]) -> torch.Tensor:
        """The model's score of each text ``[B]`` float64 (float32 forwards), ``batch_size``
        rows per forward."""
        out = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True)
            enc = {k: v.to(self.device) for k, v in enc.items() if k != "token_type_ids"}
            logits = self.model(**enc).logits  # [b, 1]
            out.append(logits[:, 0].double().cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)

    def __call__(self, completions: Sequence[str], prompts: Sequence[str]) -> list[float]:
        scores = self.raw_scores(self.texts(completions, prompts))
        with self._lock:
            self._stats["reward_model/rows"] += len(scores)
            self._stats["reward_model/score_sum"] += float(scores.sum())
        return normalise(scores, self.norm, prompts).tolist()

    def drain_metrics(self) -> dict[str, float]:
        """Counts since the last call (summed over ranks by the recipe): rows scored and the
        sum of their raw scores."""
        with self._lock:
            stats, self._stats = self._stats, dict.fromkeys(self._stats, 0.0)
        return stats


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(path: str, base: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from microrl.engine.checkpoint import reward_model as engine_rm

    where = f"task.reward_model={path!r}"
    if engine_rm.is_engine_checkpoint(path):
        if not base:
            raise ValueError(
                f"{where} is an engine checkpoint (manifest.json), which holds only the trained "
                "tensors: set task.reward_model_base to the base model it was trained from "
                "(docs/tasks.md#reward-models)"
            )
        try:
            model = engine_rm.load_reward_model_checkpoint(path, base)
            return model, AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{where} with task.reward_model_base={base!r}: {first}") from err
    if base:
        raise ValueError(
            f"task.reward_model_base={base!r} is set, but {where} is not an engine checkpoint "
            "(no manifest.json): a sequence-classification checkpoint needs no base"
        )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{where} could not be loaded as a sequence-classification model with its tokenizer "
            f"(nor is it a RewardModelEngine checkpoint): {first}"
        ) from err
    return model, tokenizer

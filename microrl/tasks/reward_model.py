"""A scalar reward model as a reward term: ``task.reward_model.path=path`` (docs/tasks.md#reward-models).

The model is a transformers sequence-classification checkpoint with one label (what
``export_merged_model`` writes for a trained :class:`~microrl.engine.RewardModelEngine`, or any
``*ForSequenceClassification`` on the Hub), or a ``RewardModelEngine`` checkpoint
(``engine.save_checkpoint``) with the base model it was trained from (``task.reward_model.base``:
:mod:`~microrl.engine.checkpoint.reward_model`). It runs as a frozen ``RewardModelEngine``
(``frozen=True``) under the run's precision rules (``actor.dtype``, ``actor.device``): its
weights stored in the compute dtype (bf16 where the run autocasts), the score head in float32;
under ``torchrun`` sharded with FSDP2 over the ranks like the policy (rank 0 reads the
checkpoint, each GPU holds 1/N of it), so scoring is a collective (:attr:`RewardModelScorer.
collective`). Each row is scored as text with the reward model's **own** tokenizer: ``prompt
+ completion`` (the prompt as the policy saw it, after any chat template), or, with
``chat_template``, the reward model's chat template over a user turn (the prompt) and an
assistant turn (the completion). Text, not the sampled ids, because a reward model's vocabulary
is in general not the policy's. The engine runs ``batch_size`` rows per micro-batch and pools
each row's last real token.

``norm``: ``none`` (raw scores), ``batch`` (standardised over the rows of one call: this
process's rollout) or ``group`` (standardised over the rows of one prompt). Thread-safe: the
recipes may score in a background thread (docs/async.md) while evaluating in the main one (not
under ``torchrun``, where every rank scores on its trainer thread, in step).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from microrl.configs.engine import EngineConfig

__all__ = ["NORMS", "RewardModelScorer", "normalise", "scoring_config"]

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


def scoring_config(
    run: EngineConfig | None, batch_size: int, device: str | torch.device | None = None
) -> EngineConfig:
    """The reward model's engine config: the run's numerics (``dtype``, ``device``,
    ``disable_dropout``, ``seed``; ``run`` is the actor's config, None: the defaults),
    ``batch_size`` rows per micro-batch, no LoRA, no parallelism but FSDP2's data parallelism.
    ``device`` overrides the run's."""
    run = run or EngineConfig()
    return EngineConfig(
        micro_batch_size=batch_size,
        dtype=run.dtype,
        device=str(torch.device(device)) if device is not None else run.device,
        disable_dropout=run.disable_dropout,
        seed=run.seed,
    )


class RewardModelScorer:
    """``scorer(completions, prompts) -> list[float]``: the reward model's score of each row.

    Args:
        path: a local sequence-classification checkpoint (with its tokenizer), a Hub id, or a
            ``RewardModelEngine`` checkpoint directory (then ``base`` is needed).
        base: the base model an engine checkpoint was trained from (its tokenizer is used).
        batch_size: rows per forward.
        norm: ``none``, ``batch`` or ``group`` (module docstring).
        chat_template: render rows with the reward model's chat template.
        device: where the model runs; None: the run's ``engine_config.device`` (``auto``: this
            rank's GPU when CUDA is available, else the CPU). Chosen here, in the caller's
            thread: a background thread's current GPU is always the first.
        model, tokenizer: an already loaded ``*ForSequenceClassification`` and tokenizer
            instead of ``path``'s.
        engine_config: the run's engine config (the actor's): the precision rules the reward
            model follows (:func:`scoring_config`).

    Raises ``ValueError`` naming ``task.reward_model.path``: a path that holds no sequence
    classifier, a classifier with more than one label, a tokenizer with neither pad nor EOS
    token, or ``chat_template`` without a template; naming ``task.reward_model.base``: an
    engine checkpoint without it, a base that does not fit the checkpoint, or a base given for
    a path that is not an engine checkpoint.
    """

    config_key = "task.reward_model.path"

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
        engine_config: EngineConfig | None = None,
    ) -> None:
        if norm not in NORMS:
            raise ValueError(f"task.reward_model.norm must be one of {', '.join(NORMS)}: {norm!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"task.reward_model.batch_size must be an int >= 1: {batch_size!r}")
        self.path = str(path) if path is not None else getattr(model, "name_or_path", "?")
        config = scoring_config(engine_config, batch_size, device)
        if model is None or tokenizer is None:
            self.engine, tokenizer = _load(self.path, base, config)
        else:
            self.engine = _engine(model, config, f"task.reward_model.path={self.path!r}")
        self.device = self.engine.device
        self.tokenizer = tokenizer
        self.norm = norm
        self.chat_template = chat_template
        self._lock = threading.Lock()
        self._check()
        self._stats = {"reward_model/rows": 0.0, "reward_model/score_sum": 0.0}

    def __repr__(self) -> str:
        return f"RewardModelScorer({self.path!r}, norm={self.norm!r})"

    @property
    def collective(self) -> bool:
        """Whether scoring is a collective (under ``torchrun``: the model is sharded over the
        ranks): every rank then calls the scorer in the same order, on its trainer thread."""
        return self.engine.dp_group is not None

    def _check(self) -> None:
        where = f"task.reward_model.path={self.path!r}"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"{where}: its tokenizer has neither a pad nor an EOS token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        if self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"task.reward_model.chat_template=true, but {where}'s tokenizer has no chat "
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

    def raw_scores(self, texts: Sequence[str]) -> torch.Tensor:
        """The model's score of each text ``[B]`` float64 (the engine's float32 scores): one
        ``infer_batch`` of all the rows, ``batch_size`` per micro-batch (a collective under
        ``torchrun``, also for no row)."""
        if not texts:
            if not self.collective:
                return torch.zeros(0, dtype=torch.float64)
            batch = TensorDict(
                input_ids=torch.zeros(0, 1, dtype=torch.long),
                attention_mask=torch.zeros(0, 1, dtype=torch.bool),
                batch_size=[0],
            )
        else:
            enc = self.tokenizer(list(texts), return_tensors="pt", padding=True)
            batch = TensorDict(
                input_ids=enc["input_ids"].long(),
                attention_mask=enc["attention_mask"].bool(),
                batch_size=[len(texts)],
            )
        with self._lock:
            scores = self.engine.infer_batch(batch)["scores"]
        return scores.double().cpu()

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


def _engine(model: Any, config: EngineConfig, where: str, base: str | None = None) -> Any:
    """The frozen reward-model engine of ``model`` (a classifier object or path, or an engine
    checkpoint with ``base``)."""
    from microrl.engine import RewardModelEngine

    if not isinstance(model, (str, os.PathLike)) and not _is_classifier(type(model).__name__):
        raise ValueError(
            f"{where} is a {type(model).__name__}, not a *ForSequenceClassification: a reward "
            "model scores with a trained score head"
        )
    return RewardModelEngine(model, config, frozen=True, base=base)


def _is_classifier(name: str) -> bool:
    return name.endswith("ForSequenceClassification")


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _load(path: str, base: str | None, config: EngineConfig) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from microrl.engine.checkpoint import reward_model as engine_rm

    where = f"task.reward_model.path={path!r}"
    if engine_rm.is_engine_checkpoint(path):
        if not base:
            raise ValueError(
                f"{where} is an engine checkpoint (manifest.json), which holds only the trained "
                "tensors: set task.reward_model.base to the base model it was trained from "
                "(docs/tasks.md#reward-models)"
            )
        try:
            engine = _engine(path, config, where, base=base)
            return engine, AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{where} with task.reward_model.base={base!r}: {_first_line(err)}"
            ) from err
    if base:
        raise ValueError(
            f"task.reward_model.base={base!r} is set, but {where} is not an engine checkpoint "
            "(no manifest.json): a sequence-classification checkpoint needs no base"
        )
    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
        if not any(_is_classifier(name) for name in architectures):
            raise ValueError(
                f"its config names {architectures}, not a *ForSequenceClassification: a reward "
                "model scores with a trained score head"
            )
        return _engine(path, config, where), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{where} could not be loaded as a sequence-classification model with its tokenizer "
            f"(nor is it a RewardModelEngine checkpoint): {_first_line(err)}"
        ) from err

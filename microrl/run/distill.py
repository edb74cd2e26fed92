"""On-policy distillation in a recipe: the teacher it starts, and the step's mixed advantages
(docs/recipes.md#teachers).

Per token of a response, the advantage trained on is
``task_advantage * [teacher.task_reward] + teacher.coef * distill_advantage``, with
``distill_advantage`` the teacher's minus the student's log-prob of the sampled token
(:func:`microrl.losses.distillation_advantages`; discounted over later tokens with
``teacher.gamma > 0``). The rollout source adds the teacher's log-probs to each round before
its rewards (:func:`teacher_scoring`); a batch without them is scored here.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict

from microrl.losses import distillation_advantages
from microrl.rollout import Rollout
from microrl.run.dist import Dist, train_threads
from microrl.run.teacher import TEACHER_LOGPROBS_KEY, Teacher, VLLMTeacher, make_teacher

__all__ = [
    "mix_teacher_advantages",
    "start_teacher",
    "teacher_scorer",
    "teacher_scoring",
]


def start_teacher(cfg: Any, tokenizer: Any, dist_info: Dist) -> Teacher | None:
    """The teacher of ``cfg.teacher`` (None without ``teacher.path``; a Hub id downloaded once,
    on the main process first), its vocabulary checked against the student's ``tokenizer``.
    ``cfg``: a recipe config (``teacher``, ``actor``, ``rollout.vllm``,
    ``rollout.worker_timeout_s``, ``train.num_threads``, ``output.dir``)."""
    if not cfg.teacher.enabled:
        return None
    return make_teacher(
        cfg.teacher,
        cfg.actor,
        tokenizer,
        vllm=cfg.rollout.vllm,
        num_threads=train_threads(cfg),
        timeout_s=cfg.rollout.worker_timeout_s,
        log_dir=None if dist_info.process else f"{cfg.output.dir}/vllm_logs",
        dist_info=dist_info,
        log=print if dist_info.is_main else lambda _: None,
    )


def teacher_scorer(teacher: Teacher):
    """``score(rollout)``: the teacher's log-probs added to the rollout's batch (kept when it
    holds them already), for the rollout source (:class:`~microrl.run.RolloutSource`)."""

    def score(rollout: Rollout) -> None:
        if TEACHER_LOGPROBS_KEY not in rollout.batch:
            rollout.batch[TEACHER_LOGPROBS_KEY] = teacher.score(rollout.batch)

    return score


def mix_teacher_advantages(
    batch: TensorDict,
    task_advantages: torch.Tensor,
    config: Any,
    teacher: Teacher,
    dist_info: Dist,
    *,
    waited_s: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages ``[B, T]`` trained on, mixed from ``task_advantages`` ``[B, T]`` and the
    distillation advantages (``config``: the ``teacher`` section), and the metrics:
    ``teacher/reverse_kl`` (the token mean of ``log pi_student - log pi_teacher`` on the
    sampled tokens, over every rank), ``teacher/wait_s`` (how long the trainer waited for the
    teacher: the whole scoring when it runs here; ``waited_s`` when the producer scored).

    The student's log-probs are ``old_logprobs`` (the trainer's, at ``actor.temperature``), or
    with the bypass the sampler's ``rollout_logprobs``, which are the trainer's own then."""
    student_key = "old_logprobs" if "old_logprobs" in batch else "rollout_logprobs"
    wait = waited_s or 0.0
    if TEACHER_LOGPROBS_KEY not in batch:
        started = time.perf_counter()
        batch[TEACHER_LOGPROBS_KEY] = teacher.score(batch)
        wait = time.perf_counter() - started
    mask = batch["loss_mask"].bool()
    teacher_lp, student_lp = batch[TEACHER_LOGPROBS_KEY], batch[student_key]
    distill = distillation_advantages(teacher_lp, student_lp, mask, gamma=config.gamma)
    task = task_advantages if config.task_reward else torch.zeros_like(task_advantages)
    advantages = task + config.coef * distill
    gap = torch.where(mask, student_lp.double() - teacher_lp.double(), 0.0)
    kl_sum, tokens, wait_sum = dist_info.sum([float(gap.sum()), float(mask.sum()), wait])
    metrics = {
        "teacher/reverse_kl": kl_sum / max(tokens, 1.0),
        "teacher/wait_s": wait_sum / dist_info.world_size,
    }
    return advantages, metrics


def teacher_scoring(teacher: Teacher | None, dist_info: Dist) -> dict[str, Any]:
    """:func:`~microrl.run.start_rollouts`' scoring of ``teacher`` in the rollout source (none
    without a teacher): its ``scorer`` and whether it is a collective (an engine teacher under
    ``torchrun``, or an sp group's data rank), which scores on the trainer's thread."""
    if teacher is None:
        return {}
    collective = dist_info.replicas > 1 or (
        dist_info.world_size > 1 and not isinstance(teacher, VLLMTeacher)
    )
    return {"scorer": teacher_scorer(teacher), "scorer_collective": collective}

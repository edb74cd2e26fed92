"""On-policy distillation in a recipe: the teacher it starts, and the step's mixed advantages
``task_advantage * [teacher.task_reward] + teacher.coef * distill_advantage`` per token
(docs/recipes.md#teachers).
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

__all__ = ["mix_teacher_advantages", "start_teacher", "teacher_scoring"]


def start_teacher(cfg: Any, tokenizer: Any, dist_info: Dist) -> Teacher | None:
    """The teacher of ``cfg.teacher`` (None without ``teacher.path``), vocabulary checked."""
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


def mix_teacher_advantages(
    batch: TensorDict,
    task_advantages: torch.Tensor,
    config: Any,
    teacher: Teacher,
    dist_info: Dist,
    *,
    waited_s: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages ``[B, T]`` mixed from ``task_advantages`` ``[B, T]`` and the distillation
    advantages (``config``: the ``teacher`` section), and ``teacher/reverse_kl`` (token mean
    over every rank), ``teacher/wait_s`` (``waited_s`` when the source scored ahead). The
    student's log-probs: ``old_logprobs``, or with the bypass ``rollout_logprobs``."""
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
    return advantages, {
        "teacher/reverse_kl": kl_sum / max(tokens, 1.0),
        "teacher/wait_s": wait_sum / dist_info.world_size,
    }


def teacher_scoring(teacher: Teacher | None, dist_info: Dist) -> dict[str, Any]:
    """The rollout source's ``scorer`` of ``teacher`` and whether it is a collective (an engine
    teacher under ``torchrun``, an sp group's data rank); {} without a teacher."""
    if teacher is None:
        return {}

    def score(rollout: Rollout) -> None:  # the teacher's log-probs, unless the batch holds them
        if TEACHER_LOGPROBS_KEY not in rollout.batch:
            rollout.batch[TEACHER_LOGPROBS_KEY] = teacher.score(rollout.batch)

    collective = dist_info.replicas > 1 or (
        dist_info.world_size > 1 and not isinstance(teacher, VLLMTeacher)
    )
    return {"scorer": score, "scorer_collective": collective}

"""What both recipes do before their engines exist and around their step, written once.

- :func:`start_run`: the ranks, ``output.dir``, the threads, the base model and the task, and
  the per-rank sizes; :meth:`RunStart.resume` then seeds the loop per rank and, with
  ``--resume``, restores the checkpoint into the engines.
- :func:`sampling_params`, :func:`overlong_shaping`: the step's sampling and DAPO's overlong
  penalty from the config.
- :func:`save_if_due`: the checkpoint every ``output.save_every`` steps.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.positions import check_positions, position_limit
from microrl.run.base_model import prepare_base_model
from microrl.run.checkpoint import load_run
from microrl.run.cli import prepare_output
from microrl.run.dist import Dist, per_rank, train_threads
from microrl.run.session import save_checkpoint
from microrl.run.vision import image_encoder_for
from microrl.tasks import Task, is_agent_task, is_episode_task, make_task, overlong_penalty

__all__ = [
    "RunStart",
    "check_prompt_positions",
    "overlong_shaping",
    "sampling_params",
    "save_if_due",
    "start_run",
]


@dataclass(frozen=True)
class RunStart:
    """A recipe's run before its engines: what :func:`start_run` prepared."""

    cfg: Any
    args: argparse.Namespace
    #: the data ranks: under sequence parallelism an sp group's processes are one
    dist_info: Dist
    #: ``print`` on the main process, silent on the others
    log: Callable[[str], None]
    tokenizer: Any
    #: the base model's local checkpoint directory
    base_path: str
    task: Task
    #: this data rank's share of ``rollout.prompts_per_step`` and ``train.mini_batch_size``
    prompts_per_rank: int
    mini_batch_per_rank: int
    #: when the set-up began (``time.perf_counter()``), for the step-0 line
    t_setup: float
    #: the sampler's image encoder: a vision-language policy's (microrl/run/vision.py), else None
    image_encoder: Any = None

    def resume(self, engines: Mapping[str, Any]) -> tuple[random.Random, int, dict[str, Any]]:
        """``(rng, start_step, restored)``: the loop's prompt stream and torch's sampling and
        shuffling stream, seeded differently per data rank from ``train.seed``; with
        ``--resume`` the checkpoint's step, with ``engines``, both streams and the extra state
        (``restored``) loaded from it, else step 0 and nothing restored."""
        seed = self.cfg.train.seed * 1000 + self.dist_info.rank
        rng = random.Random(seed)
        torch.manual_seed(seed)
        start_step, restored = 0, {}
        if self.args.resume:
            out_dir = self.cfg.output.dir
            start_step = load_run(
                out_dir, engines, rng=rng, dist_info=self.dist_info, extra_state=restored
            )
            self.log(f"resumed from {out_dir}/checkpoint at step {start_step}")
        return rng, start_step, restored


def start_run(cfg: Any, args: argparse.Namespace) -> RunStart:
    """Everything a recipe does before it builds its engines, on every process.

    Joins the ranks (:meth:`Dist.init`), makes ``output.dir`` ready (``--resume`` /
    ``--overwrite``: :func:`~microrl.run.cli.prepare_output`), sets ``train.num_threads``
    (:func:`~microrl.run.dist.train_threads`),
    prepares the base model (every process as its own rank: a toy model is built once), the
    task (its longest prompt and ``rollout.max_new_tokens`` checked against the model's
    positions: :func:`check_prompt_positions`) and a vision-language policy's image encoder
    (checked against the task's images and the sampler:
    :func:`~microrl.run.vision.image_encoder_for`), splits
    ``rollout.prompts_per_step`` and ``train.mini_batch_size`` over the data ranks (a
    ``ValueError`` naming the key when they do not divide), and seeds torch with ``train.seed``,
    the same on every rank, so that the engines built next start from the same LoRA weights.
    ``cfg``: a recipe config (``model``, ``task``, ``rollout``, ``actor``, ``train``, ``output``).
    """
    dist_info = Dist.init()
    prepare_output(cfg, args, dist_info)  # --resume / --overwrite; a checkpoint left aside
    if threads := train_threads(cfg):
        torch.set_num_threads(threads)
    log = print if dist_info.is_main else (lambda *_: None)
    # Under sequence parallelism an sp group's processes are one data rank: the same prompts
    # (PPO's actor and critic share the layout: configs/examples.py checks the sizes are equal).
    data = dist_info.for_sequence_parallel(cfg.actor.sequence_parallel_size)
    prompts = per_rank(cfg.rollout.prompts_per_step, "rollout.prompts_per_step", data)
    mini_batch = per_rank(cfg.train.mini_batch_size, "train.mini_batch_size", data)
    t_setup = time.perf_counter()
    tokenizer, base_path = prepare_base_model(
        cfg.model, cfg.task, dist_info, cfg.rollout.max_new_tokens, log
    )
    # A reward model follows the actor's precision rules (docs/tasks.md#reward-models).
    task = make_task(cfg.task, tokenizer, engine_config=cfg.actor)  # (docs/tasks.md)
    check_prompt_positions(task, tokenizer, base_path, cfg.rollout.max_new_tokens)
    # A vision-language policy's encoder; images it or the sampler cannot take fail here.
    encoder = image_encoder_for(cfg, base_path, task)
    torch.manual_seed(cfg.train.seed)  # the same LoRA initialisation on every rank
    return RunStart(
        cfg, args, data, log, tokenizer, base_path, task, prompts, mini_batch, t_setup, encoder
    )


# Rows of a prompt file tokenized at start for the positions check: those with the most text
# (token counts follow the text's length closely, so the longest in tokens is among them).
CHECKED_PROMPTS = 4096


def check_prompt_positions(task: Task, tokenizer: Any, base_path: str, max_new_tokens: int) -> None:
    """``ValueError`` naming ``rollout.max_new_tokens`` when the task's longest prompt plus it
    runs past the positions of the model at ``base_path``
    (:func:`~microrl.rollout.positions.check_positions`): of a prompt file, the
    :data:`CHECKED_PROMPTS` rows with the most text (tokenizing every row of a large file
    costs more than reading it); of a generated task, its held-out prompts. The ``hf`` sampler checks every batch
    exactly; episodes' and agents' first inputs are rendered later (an environment's ``init``,
    the agent), so only it checks them."""
    if is_episode_task(task) or is_agent_task(task):
        return
    from transformers import AutoConfig

    limit = position_limit(AutoConfig.from_pretrained(base_path))
    if limit is None:
        return
    longest_rows = getattr(task, "longest_problems", None)
    problems = task.eval_problems() if longest_rows is None else longest_rows(CHECKED_PROMPTS)
    prompts = [p.prompt for p in problems]
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    worst = max(range(len(prompts)), key=lengths.__getitem__)
    what = f"the task's longest prompt ({prompts[worst]!r:.60})"
    check_positions(lengths[worst], max_new_tokens, limit, what=what)


def sampling_params(cfg: Any) -> SamplingParams:
    """A training step's sampling: ``rollout.group_size`` responses per prompt at the loss's
    temperature (``actor.temperature``, plain ancestral sampling), ``rollout.max_new_tokens``."""
    return SamplingParams(
        num_samples=cfg.rollout.group_size,
        temperature=cfg.actor.temperature,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )


def overlong_shaping(cfg: Any) -> Callable[[Rollout], torch.Tensor]:
    """DAPO's soft overlong penalty of each row of a rollout, ``[B]`` on the rollout's device
    (:func:`~microrl.tasks.overlong_penalty` of its response length, ``<eos>`` included; 0 with
    ``task.rewards.overlong_buffer=0``): the reward trained on is the score plus it."""
    limit, buffer = cfg.rollout.max_new_tokens, cfg.task.rewards.overlong_buffer

    def penalty(rollout: Rollout) -> torch.Tensor:
        lengths = rollout.batch["loss_mask"].sum(1)  # response tokens, <eos> included
        return overlong_penalty(lengths, limit, buffer, cfg.task.rewards.overlong_penalty)

    return penalty


def save_if_due(
    cfg: Any,
    engines: Mapping[str, Any],
    step: int,
    *,
    rng: random.Random,
    dist_info: Dist,
    extra_state: Callable[[], Mapping[str, Any]] | None = None,
) -> None:
    """The run checkpoint (:func:`~microrl.run.checkpoint.save_run`) after every
    ``output.save_every``-th step (never with 0). ``extra_state``: returns more of the loop's
    state (e.g. :meth:`RolloutSource.extra_state`), called only when a checkpoint is due,
    since collecting it may wait (for the rollouts sampled ahead)."""
    if cfg.output.save_every and step % cfg.output.save_every == 0:
        extra = extra_state and extra_state()
        save_checkpoint(cfg, engines, step, rng=rng, dist_info=dist_info, extra_state=extra)

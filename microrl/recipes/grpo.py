"""GRPO + LoRA: the recipe that ``microrl grpo`` and ``examples/grpo_lora.py`` run.

What GRPO does (Shao et al. 2024, "DeepSeekMath"): for each prompt, sample a *group* of responses
from the current policy and score them (1 if the sum is right, else 0). A response's advantage is
its score standardised within its group, ``(s - mean_g) / std_g``: better than its siblings ->
pushed up, worse -> pushed down; a group that is all right or all wrong teaches nothing (0). No
value network is needed. The update is PPO's clipped surrogate on these advantages, run for a few
epochs over mini-batches of the rollout, with the log-probs of the sampling policy as the anchor
of the ratio. Only a LoRA adapter trains; the base model with the adapter switched off is the
reference policy whose KL is reported every ``train.kl_metric_every`` steps (and penalised, on
every step, when ``actor.policy_loss.kl_coef > 0``). ``actor.policy_loss.bypass_mode=true`` takes
the sampler's log-probs as the anchor instead of recomputing them (docs/losses.md). DAPO's
knobs (docs/recipes.md#dapos-knobs): ``rollout.dynamic_sampling=true`` samples more prompts until
every group's rewards differ, ``task.rewards.overlong_buffer=N`` adds the soft overlong penalty
to the reward, ``actor.mask_truncated=true`` trains on no response cut at ``rollout.max_new_tokens``.

Each step below: 1 sample -> 2 score -> 3 old/ref log-probs -> 4 advantages -> 5 update -> 6 log.
The base model is warm-started with supervised steps the first time (microrl/run/base_model.py).
Sampling is ``rollout.backend``: ``hf`` (transformers ``generate`` on the trained model) or ``vllm``
(a colocated vLLM engine, synced after the updates; docs/rollouts.md). With
``rollout.max_staleness=k > 0`` worker processes (or vLLM servers) sample the next steps'
rollouts while this one trains, with weights at most k steps old, pushed and checked after every
step (the step reads the same for every k); the old log-probs (3 below) are then the trainer's
own, the proximal policy, and the sampler's the behaviour policy (docs/async.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from microrl.configs.examples import GRPOExampleConfig
from microrl.engine import ActorEngine
from microrl.losses import broadcast_to_tokens
from microrl.recipes import recipe_help
from microrl.rollout import Rollout
from microrl.run import (
    StopOnInterrupt,
    close_on_exit,
    evaluator,
    finish,
    group_advantages,
    overlong_shaping,
    parse_cli,
    rollout_metrics,
    sample_rows,
    sampling_params,
    save_if_due,
    start_rollouts,
    start_run,
    start_tracking,
    step_metrics,
)
from microrl.run.distill import mix_teacher_advantages, start_teacher

__all__ = ["USAGE", "main"]

USAGE = """\
GRPO + LoRA: teach a tiny Llama-architecture model to add, rewarded only by a right answer.

Launch (CPU by default; the config is configs/grpo_lora.yaml, any key can be overridden; each run
writes to its own output.dir):

    microrl grpo                                  # writes outputs/grpo_lora
    microrl grpo train.steps=100 actor.optim.lr=1e-3 output.dir=outputs/try
    torchrun --nproc_per_node 2 -m microrl grpo output.dir=outputs/grpo_2ranks
                                                  # data parallel, FSDP2 (gloo on CPU)
    microrl grpo --resume                         # continue after Ctrl-C or a finished run
    microrl grpo rollout.backend=vllm output.dir=outputs/grpo_vllm
                                                  # sample with vLLM (docs/rollouts.md)
    microrl grpo rollout.max_staleness=1 output.dir=outputs/grpo_async
                                                  # asynchronous: a worker samples a step ahead
    microrl grpo task.name=dataset task.dataset.train_file=my.jsonl \\
        task.rewards.functions=my:score output.dir=outputs/my_data
                                                  # your data and reward (docs/tasks.md)
    microrl grpo --overwrite                      # start again over a previous run
    microrl grpo --help                           # every option, its default, its meaning
"""


def main(argv: Sequence[str] | None = None, *, prog: str | None = None, usage: str = USAGE) -> int:
    """Run GRPO with the command line ``argv`` (default ``sys.argv[1:]``); the exit code (0, or
    130 after Ctrl-C). ``prog`` and ``usage``: the command's name and how to launch it, for
    ``--help`` (``examples/grpo_lora.py`` gives its own)."""
    # 0. Set-up: the config (configs/grpo_lora.yaml + the command line), the ranks, the base
    #    model, the task (addition, word_problems, a file, or a multi-turn task played against
    #    environments: docs/tasks.md), the policy (a LoRA on the base model: under torchrun only
    #    rank 0 reads it) and the loop's state (a checkpoint's with --resume).
    help_text = recipe_help(usage, __doc__)
    cfg, args = parse_cli(GRPOExampleConfig, "grpo_lora.yaml", help_text, argv, prog=prog)
    run = start_run(cfg, args)
    dist_info, task, prompts_per_rank = run.dist_info, run.task, run.prompts_per_rank
    mini_batches = prompts_per_rank * cfg.rollout.group_size // run.mini_batch_per_rank
    engine = ActorEngine(run.base_path, cfg.actor)
    rng, start_step, restored = run.resume({"actor": engine})
    sampling, overlong = sampling_params(cfg), overlong_shaping(cfg)
    # teacher.path: on-policy distillation's frozen teacher (docs/recipes.md#teachers).
    teacher = start_teacher(cfg, run.tokenizer, dist_info)
    # Every step's rollout: rollout.backend's sampler (with rollout.max_staleness > 0 in
    # processes of its own, sampling ahead; a checkpoint's rounds first), the rows scored (the
    # teacher's log-probs too) and, with dynamic sampling, filtered. Evaluation samples the
    # policy: the trainer's current weights.
    source, policy = start_rollouts(
        cfg, engine, run.tokenizer, task, sampling, rng, prompts_per_rank,
        start_step=start_step, restored=restored, dist_info=dist_info,
        image_encoder=run.image_encoder,  # a vision-language policy's (docs/rollouts.md#images)
        shaping=overlong, teacher=teacher,
    )  # fmt: skip
    evaluate = evaluator(policy, task, dist_info, cfg.rollout.max_new_tokens, cfg.rollout)
    tracker, first_accuracy = start_tracking(cfg, dist_info, start_step, evaluate, run.t_setup)

    step, t_train, interrupted, metrics, extra = start_step, time.perf_counter(), False, {}, None
    with close_on_exit(source, teacher), StopOnInterrupt(dist_info) as stop:
        for step in stop.steps(start_step + 1, cfg.train.steps + 1):  # an error names its step
            t0 = time.perf_counter()
            # 1-2. A group of responses per prompt from the policy, scored (a multi-turn task
            #    plays whole episodes instead: docs/rollouts.md), until the groups' rewards
            #    differ (rollout.dynamic_sampling, DAPO), without the rows of failed episodes.
            #    The batch carries the sampler's rollout_logprobs (the engine reports mismatch/*).
            problems, rollout, scores, sampled = source.take(step)
            # Built on the host, moved to the engine's device once: from here on every tensor
            # is the engine's (docs/batch.md#devices).
            rollout, scores = rollout.to(engine.device), scores.to(engine.device)
            batch = rollout.batch
            penalty = overlong(rollout)  # the reward trained on is scores + penalty
            # 3-4. Old and reference log-probs, group-normalised advantages (+ the teacher's).
            old, distilled = estimate_advantages(
                engine, rollout, scores + penalty, cfg, step=step, teacher=teacher,
                dist_info=dist_info, teacher_wait_s=source.scorer_wait_s,
            )  # fmt: skip
            # 5. PPO-style epochs over shuffled mini-batches; the engine splits each mini-batch
            #    into micro-batches and normalises the loss over the whole mini-batch.
            #    As many mini-batches on every rank, also when failed episodes left fewer rows.
            updates = []
            for _ in range(cfg.train.ppo_epochs):
                for rows in torch.randperm(batch.batch_size[0]).tensor_split(mini_batches):
                    updates.append(engine.train_batch(batch[rows]))
            engine.release_host_memory()  # offloaded copies: unpinned before sampling
            source.sync(engine)  # the new weights to the sampler (checked); sample further
            # 6. Metrics (counts summed over ranks), eval, checkpoint. The entropy comes from
            #    the old log-prob pass (none with the bypass), kl from the updates of a step
            #    with reference log-probs.
            metrics = step_metrics(
                batch, scores, penalty, old, updates, dist_info, t0,
                overlong=cfg.task.rewards.overlong_buffer > 0,
                groups=rollout.group_ids,  # frac_reward_zero_std: groups that teach nothing
            )  # fmt: skip
            # teacher/*, dynamic_sampling/*, staleness/* and sync/probe_* (docs/async.md)
            metrics.update(distilled | sampled)
            metrics.update(rollout_metrics(task, rollout, dist_info))  # episodes/, agent/, judge/
            if cfg.train.eval_due(step):
                metrics["eval/accuracy"] = evaluate()
            tracker.log(step, metrics)
            # A few completions every output.log_samples_every steps (samples.jsonl, trackers).
            tracker.log_samples(step, sample_rows(rollout, problems, scores, run.tokenizer))
            if stop.should_stop():
                interrupted = True
                break
            save_if_due(
                cfg, {"actor": engine}, step, rng=rng, dist_info=dist_info,
                extra_state=source.extra_state,  # the rounds not trained yet
            )  # fmt: skip
            # The step's device tensors (its batch, with the images' pixels) go now, not once
            # the next step has sampled beside them (docs/batch.md#images).
            del rollout, batch, scores, penalty, old
        extra = source.extra_state()  # the rounds not trained yet, for --resume

    # 7. The end: a checkpoint, then (unless Ctrl-C stopped the run: exit code 130, --resume)
    #    the adapter, the curves and the summary.
    return finish(
        cfg, {"actor": engine}, tracker, step=step, start_step=start_step, rng=rng,
        dist_info=dist_info, interrupted=interrupted, first_accuracy=first_accuracy,
        last_metrics=metrics, train_time=time.perf_counter() - t_train,
        tokenizer=run.tokenizer,  # saved beside the merged model (output.export_merged)
        extra_state=extra,
    )  # fmt: skip


def estimate_advantages(
    engine: ActorEngine,
    rollout: Rollout,
    rewards: torch.Tensor,
    cfg: GRPOExampleConfig,
    *,
    step: int,
    teacher=None,
    dist_info=None,
    teacher_wait_s: float | None = None,
) -> tuple[TensorDict | None, dict[str, float]]:
    """Steps 3-4 on ``rollout.batch`` (``[B, T]``, ``rewards [B]``) in place; returns the old
    log-prob pass (its entropy is logged; None with the bypass) and the teacher's metrics.

    3. The sampling policy's log-probs (the ratio's anchor), recomputed by the engine unless
       ``actor.policy_loss.bypass_mode`` takes the sampler's own; the reference's (the base
       model: the adapter off) only when the KL is penalised or reported this step.
    4. Group-normalised advantages on the response tokens: a group is one prompt's rows, all
       sampled on this rank, so its statistics are complete here (an agent's episode counts
       once); plus ``teacher.coef`` x (teacher - student log-prob) per token with a teacher.
    """
    batch, old = rollout.batch, None
    if not cfg.actor.policy_loss.bypass_mode:
        old = engine.infer_batch(batch)
        batch["old_logprobs"] = old["logprobs"]
    if cfg.train.kl_due(step, cfg.actor.policy_loss.kl_coef):
        with engine.disable_adapter():
            batch["ref_logprobs"] = engine.infer_batch(batch)["logprobs"]
    advantages = group_advantages(rollout, rewards, cfg.rollout.group_size)
    batch["advantages"] = broadcast_to_tokens(advantages, batch["loss_mask"])
    if teacher is None:
        return old, {}
    batch["advantages"], distilled = mix_teacher_advantages(
        batch, batch["advantages"], cfg.teacher, teacher, dist_info, waited_s=teacher_wait_s
    )
    return old, distilled


if __name__ == "__main__":
    sys.exit(main())

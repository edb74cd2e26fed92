"""PPO + LoRA with a critic: the recipe that ``microrl ppo`` and ``examples/ppo_lora.py`` run.

What PPO does (Schulman et al. 2017, as used for RLHF by Ouyang et al. 2022): sample responses,
score them, and put the score on the *last* response token as the reward. A critic predicts, at
every response token, the value of the rest of the response; generalised advantage estimation
(GAE, Schulman et al. 2016) turns rewards and values into a per-token advantage (better or worse
than the critic expected) and a return, the critic's regression target. The actor takes clipped
surrogate steps on the whitened advantages plus a KL penalty to the reference policy (the base
model with the LoRA adapter switched off), which keeps it from drifting to degenerate text. Actor
and critic are two engines, each a LoRA on its own copy of the base model (the critic's lm head
replaced by a value head). Under torchrun each rank samples its own prompts, and the whitening
statistics are those of the whole rollout over all ranks, so the update is the one a single
process would make on the same rollout; under sequence parallelism the processes of an sp group
are one data rank (docs/distributed.md).

With ``rollout.max_staleness=k > 0`` worker processes (or vLLM servers) sample the next steps'
rollouts while this one trains, with the actor's weights at most k steps old, pushed and checked
after every step (the step reads the same for every k). The old log-probs and the critic's values (3 below) are still computed here, on the
collected rollout at the current weights: the old log-probs are the proximal policy the ratio is
anchored on, the sampler's the behaviour policy (``actor.policy_loss.decoupled_is_cap``;
docs/async.md).

Each step: 1 sample -> 2 score -> 3 old/ref log-probs and values -> 4 GAE -> 5 update both -> 6 log.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from microrl.configs.examples import PPOExampleConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.losses import gae_advantages, scores_to_token_rewards, whiten
from microrl.recipes import recipe_help
from microrl.run import (
    Dist,
    StopOnInterrupt,
    close_on_exit,
    evaluator,
    finish,
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

__all__ = ["USAGE", "estimate_advantages", "main", "ppo_update"]

USAGE = """\
PPO + LoRA with a critic: the same addition task, a learned value baseline instead of groups.

Launch (CPU by default; the config is configs/ppo_lora.yaml, any key can be overridden):

    microrl ppo                                   # writes outputs/ppo_lora
    microrl ppo train.steps=100 actor.policy_loss.kl_coef=0.05 output.dir=outputs/kl
    torchrun --nproc_per_node 2 -m microrl ppo output.dir=outputs/ppo_2ranks
    torchrun --nproc_per_node 2 -m microrl ppo actor.sequence_parallel_size=2 \\
        critic.sequence_parallel_size=2 output.dir=outputs/ppo_sp  # Ulysses: both split tokens
    microrl ppo --resume                          # continue it (saved config + overrides)
    microrl ppo rollout.backend=vllm output.dir=outputs/ppo_vllm
                                                  # sample with vLLM (docs/rollouts.md)
    microrl ppo rollout.max_staleness=1 output.dir=outputs/ppo_async
                                                  # asynchronous: a worker samples a step ahead
    microrl ppo task.name=dataset task.dataset.train_file=my.jsonl \\
        task.rewards.functions=my:score output.dir=outputs/my_data_ppo
                                                  # your data and reward (docs/tasks.md)
"""


def main(argv: Sequence[str] | None = None, *, prog: str | None = None, usage: str = USAGE) -> int:
    """Run PPO with the command line ``argv`` (default ``sys.argv[1:]``); the exit code (0, or
    130 after Ctrl-C). ``prog`` and ``usage``: the command's name and how to launch it, for
    ``--help`` (``examples/ppo_lora.py`` gives its own)."""
    # 0. Set-up: the config (configs/ppo_lora.yaml + the command line), the ranks, the base
    #    model, the task (addition, word_problems or a file: docs/tasks.md), the actor and the
    #    critic (a LoRA each on its own copy of the base model: under torchrun only rank 0 reads
    #    it) and the loop's state (a checkpoint's with --resume).
    help_text = recipe_help(usage, __doc__)
    cfg, args = parse_cli(PPOExampleConfig, "ppo_lora.yaml", help_text, argv, prog=prog)
    run = start_run(cfg, args)
    dist_info, task, prompts_per_rank = run.dist_info, run.task, run.prompts_per_rank
    actor = ActorEngine(run.base_path, cfg.actor)
    critic = CriticEngine(run.base_path, cfg.critic)
    engines = {"actor": actor, "critic": critic}
    rng, start_step, restored = run.resume(engines)
    sampling, overlong = sampling_params(cfg), overlong_shaping(cfg)
    # Every step's rollout: rollout.backend's sampler (with rollout.max_staleness > 0 in
    # processes of its own, sampling ahead with the actor's pushed weights; a checkpoint's rounds
    # first), the rows scored. Evaluation samples the policy: the actor's current weights.
    source, policy = start_rollouts(
        cfg, actor, run.tokenizer, task, sampling, rng, prompts_per_rank,
        start_step=start_step, restored=restored, dist_info=dist_info,
        image_encoder=run.image_encoder,  # a vision-language policy's (docs/rollouts.md#images)
        shaping=overlong,
    )  # fmt: skip
    evaluate = evaluator(policy, task, dist_info, cfg.rollout.max_new_tokens)
    tracker, first_accuracy = start_tracking(cfg, dist_info, start_step, evaluate, run.t_setup)

    step, t_train, interrupted, metrics, extra = start_step, time.perf_counter(), False, {}, None
    with close_on_exit(source), StopOnInterrupt(dist_info) as stop:
        for step in stop.steps(start_step + 1, cfg.train.steps + 1):  # an error names its step
            t0 = time.perf_counter()
            # 1-2. Responses from the policy (the loss's temperature), scored: the answer text's
            #    score is the reward of the last response token (step 4). The batch carries the
            #    sampler's rollout_logprobs (the engine reports the mismatch/*); sampled ahead
            #    (rollout.max_staleness), its rows are a policy up to k steps old, and the old
            #    log-probs and values (3) are the trainer's, computed now.
            problems, rollout, scores, sampled = source.take(step)
            # Built on the host, moved to the engines' device once (docs/batch.md#devices).
            rollout, scores = rollout.to(actor.device), scores.to(actor.device)
            batch = rollout.batch
            penalty = overlong(rollout)  # DAPO's (0 with no overlong buffer): reward + it
            # 3-4. Old/ref log-probs and old values; GAE advantages whitened over all ranks.
            with_ref = cfg.train.kl_due(step, cfg.actor.policy_loss.kl_coef)
            old = estimate_advantages(
                actor, critic, batch, scores + penalty, cfg, with_ref=with_ref, dist_info=dist_info
            )
            # 5. PPO epochs over shuffled mini-batches: one actor and one critic step each.
            actor_updates, critic_updates = ppo_update(
                actor, critic, batch, cfg, run.mini_batch_per_rank
            )
            source.sync(actor)  # the new weights to the sampler (checked); sample further
            # 6. Metrics (counts summed over ranks), eval, checkpoint. The entropy comes from
            #    the old log-prob pass (none with the bypass).
            metrics = step_metrics(
                batch, scores, penalty, old, actor_updates, dist_info, t0,
                critic_updates=critic_updates, overlong=cfg.task.rewards.overlong_buffer > 0,
                # frac_reward_zero_std: a prompt's responses all scored alike (groups of 2+)
                groups=rollout.group_ids if cfg.rollout.group_size > 1 else None,
            )  # fmt: skip
            metrics.update(sampled)  # staleness/*, sync/probe_* (docs/async.md)
            metrics.update(rollout_metrics(task, rollout, dist_info))  # judge/, reward_model/
            if cfg.train.eval_due(step):
                metrics["eval/accuracy"] = evaluate()
            tracker.log(step, metrics)
            # A few completions every output.log_samples_every steps (samples.jsonl, trackers).
            tracker.log_samples(step, sample_rows(rollout, problems, scores))
            if stop.should_stop():
                interrupted = True
                break
            save_if_due(
                cfg, engines, step, rng=rng, dist_info=dist_info,
                extra_state=source.extra_state,  # the rounds not trained yet
            )  # fmt: skip
            # The step's device tensors (its batch, with the images' pixels) go now, not once
            # the next step has sampled beside them (docs/batch.md#images).
            del rollout, batch, scores, penalty, old
        extra = source.extra_state()  # the rounds not trained yet, for --resume

    # 7. The end: a checkpoint, then (unless Ctrl-C stopped the run: exit code 130, --resume)
    #    the actor's adapter, the curves and the summary.
    return finish(
        cfg, engines, tracker, step=step, start_step=start_step, rng=rng, dist_info=dist_info,
        interrupted=interrupted, first_accuracy=first_accuracy, last_metrics=metrics,
        train_time=time.perf_counter() - t_train,
        tokenizer=run.tokenizer,  # saved beside the merged model (output.export_merged)
        extra_state=extra,
    )  # fmt: skip


def estimate_advantages(
    actor: ActorEngine,
    critic: CriticEngine,
    batch: TensorDict,
    scores: torch.Tensor,
    cfg: PPOExampleConfig,
    *,
    with_ref: bool = True,
    dist_info: Dist | None = None,
) -> TensorDict | None:
    """Steps 3-4 on this rank's rollout ``batch`` (``[B, T]``, scores ``[B]``), in place: adds
    ``old_logprobs`` (unless ``actor.policy_loss.bypass_mode`` anchors the ratio on the
    sampler's ``rollout_logprobs``), ``ref_logprobs`` (when ``with_ref``: a KL penalty or the KL
    metric), ``old_values``, ``advantages`` and ``returns``; returns the actor's inference
    outputs (their entropy is logged), or None with the bypass.

    Everything here is per row except the whitening, whose mean and variance are those of the
    whole rollout over all data ranks (``dist_info``; default: every process is one, as without
    sequence parallelism): N ranks, each with its share of the rows, get the advantages one
    process would compute on all of them (tests/losses/test_whiten_distributed.py).
    """
    mask = batch["loss_mask"]
    # 3. Old log-probs (ratio anchor), reference log-probs (KL), old values (baseline).
    old = None
    if not cfg.actor.policy_loss.bypass_mode:
        old = actor.infer_batch(batch)
        batch["old_logprobs"] = old["logprobs"]
    if with_ref:
        with actor.disable_adapter():
            batch["ref_logprobs"] = actor.infer_batch(batch)["logprobs"]
    batch["old_values"] = critic.infer_batch(batch)["values"]
    # 4. The score is the reward of the last response token; GAE over the response tokens, then
    #    whitening over the loss tokens of every data rank (a collective; no group in one
    #    process; under sequence parallelism one process of each sp group, whose processes hold
    #    the same rows, which must count once).
    rewards = scores_to_token_rewards(scores, mask)
    advantages, returns = gae_advantages(
        rewards, batch["old_values"], mask, gamma=cfg.gae.gamma, lam=cfg.gae.lam
    )
    group = (dist_info or Dist()).data_group(actor)
    batch["advantages"] = whiten(advantages, mask, group=group)
    batch["returns"] = returns
    return old


def ppo_update(
    actor: ActorEngine,
    critic: CriticEngine,
    batch: TensorDict,
    cfg: PPOExampleConfig,
    mini_batch_per_rank: int,
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Step 5: ``train.ppo_epochs`` passes over shuffled mini-batches of this rank's rows, one
    actor and one critic optimizer step each; the engines normalise every loss over the global
    mini-batch (all ranks). Returns the actor's and the critic's update metrics."""
    actor_updates, critic_updates = [], []
    for _ in range(cfg.train.ppo_epochs):
        for rows in torch.randperm(batch.batch_size[0]).split(mini_batch_per_rank):
            actor_updates.append(actor.train_batch(batch[rows]))
            critic_updates.append(critic.train_batch(batch[rows]))
    actor.release_host_memory()  # offloaded copies: unpinned before sampling
    critic.release_host_memory()
    return actor_updates, critic_updates


if __name__ == "__main__":
    sys.exit(main())

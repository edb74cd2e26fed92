"""GRPO + LoRA: teach a tiny Llama-architecture model to add, rewarded only by a right answer.

Launch (CPU by default; the config is configs/grpo_lora.yaml, any key can be overridden; each run
writes to its own output.dir):

    python examples/grpo_lora.py                           # writes outputs/grpo_lora
    python examples/grpo_lora.py train.steps=100 actor.optim.lr=1e-3 output.dir=outputs/try
    torchrun --nproc_per_node 2 examples/grpo_lora.py output.dir=outputs/grpo_2ranks
                                                  # data parallel, FSDP2 (gloo on CPU)
    python examples/grpo_lora.py --resume                  # continue after Ctrl-C or a finished run
    python examples/grpo_lora.py rollout.backend=vllm output.dir=outputs/grpo_vllm
                                                  # sample with vLLM (docs/rollouts.md)
    python examples/grpo_lora.py rollout.max_staleness=1 output.dir=outputs/grpo_async
                                                  # asynchronous: a worker samples a step ahead
    python examples/grpo_lora.py task.name=dataset task.train_file=my.jsonl task.rewards=my:score \\
        output.dir=outputs/my_data                # your data and reward (docs/tasks.md)
    python examples/grpo_lora.py model.path=Qwen/Qwen2.5-0.5B-Instruct task.name=dataset ...
                                                  # a Hugging Face Hub model, downloaded
    python examples/grpo_lora.py --overwrite               # start again over a previous run
    python examples/grpo_lora.py --help                    # every option, its default, its meaning
    python examples/grpo_lora.py --debug ...               # an error with its full traceback

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
every group's rewards differ, ``task.overlong_buffer=N`` adds the soft overlong penalty to the
reward, ``actor.mask_truncated=true`` trains on no response cut at ``rollout.max_new_tokens``.

Each step below: 1 sample -> 2 score -> 3 old/ref log-probs -> 4 advantages -> 5 update -> 6 log.
The base model is warm-started with supervised steps the first time (microrl/run/base_model.py).
Sampling is ``rollout.backend``: ``hf`` (transformers ``generate`` on the trained model) or ``vllm``
(a colocated vLLM engine, synced after the updates; docs/rollouts.md). With
``rollout.max_staleness=k > 0`` (``hf``) a worker process samples the next steps' rollouts while
this one trains, with weights at most k steps old, pushed and checked after every step; the old
log-probs (3 below) are then the trainer's own, the proximal policy, and the sampler's the
behaviour policy (``actor.policy_loss.decoupled_is_cap``; docs/async.md).
"""

from __future__ import annotations

import random
import sys
import time

import torch

from microrl.configs.examples import GRPOExampleConfig
from microrl.engine import ActorEngine
from microrl.engine.rollout import SamplingParams
from microrl.losses import broadcast_to_tokens, check_whole_groups, grpo_advantages
from microrl.run import (
    Dist,
    StopOnInterrupt,
    close_on_exit,
    dynamic_sample,
    episode_metrics,
    evaluator,
    finish,
    load_run,
    mean_metrics,
    parse_cli,
    per_rank,
    prepare_base_model,
    prepare_output,
    sample_and_score,
    sample_rows,
    save_run,
    start_sampling,
    start_tracking,
    whole_groups,
)
from microrl.tasks import is_episode_task, make_task, overlong_penalty


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_cli(GRPOExampleConfig, "grpo_lora.yaml", __doc__, argv)
    dist_info = Dist.init()
    prepare_output(cfg, args, dist_info)  # --resume / --overwrite; a checkpoint left aside
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    log = print if dist_info.is_main else (lambda *_: None)
    # Under sequence parallelism an sp group's processes are one data rank: the same prompts.
    data = dist_info.for_sequence_parallel(cfg.actor.sequence_parallel_size)
    prompts_per_rank = per_rank(cfg.rollout.prompts_per_step, "rollout.prompts_per_step", data)
    mini_batch_per_rank = per_rank(cfg.train.mini_batch_size, "train.mini_batch_size", data)
    mini_batches = prompts_per_rank * cfg.rollout.group_size // mini_batch_per_rank

    t_setup = time.perf_counter()
    tokenizer, base_path = prepare_base_model(
        cfg.model, cfg.task, dist_info, cfg.rollout.max_new_tokens, log
    )
    # addition, word_problems, a file, or a multi-turn task played against environments
    task = make_task(cfg.task, tokenizer)  # (docs/tasks.md)
    episodes = is_episode_task(task)
    dist_info = data  # from here on (the base model is built by every process as its own rank)
    torch.manual_seed(cfg.train.seed)  # the same LoRA initialisation on every rank
    engine = ActorEngine(base_path, cfg.actor)  # under torchrun only rank 0 reads it
    # A different stream per rank: Python's for the prompts, torch's for sampling and shuffles.
    rng = random.Random(cfg.train.seed * 1000 + dist_info.rank)
    torch.manual_seed(cfg.train.seed * 1000 + dist_info.rank)
    start_step, restored = 0, {}
    if args.resume:
        start_step = load_run(
            cfg.output.dir, {"actor": engine}, rng=rng, dist_info=dist_info, extra_state=restored
        )
        log(f"resumed from {cfg.output.dir}/checkpoint at step {start_step}")
    sampling = SamplingParams(
        num_samples=cfg.rollout.group_size,
        temperature=cfg.actor.temperature,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    # rollout.backend's sampler; with rollout.max_staleness > 0 (prefetch) a worker process
    # samples the next steps (and a checkpoint's rollouts sampled ahead come first) while the
    # sampler, the trainer's current weights, only evaluates.
    sampler, prefetch = start_sampling(
        cfg, engine, tokenizer, task, sampling, rng, prompts_per_rank,
        start_step=start_step, restored=restored, dist_info=dist_info,
    )  # fmt: skip
    evaluate = evaluator(sampler, task, dist_info, cfg.rollout.max_new_tokens, cfg.rollout)

    def overlong(rollout):  # DAPO's soft overlong penalty per row; 0 with task.overlong_buffer=0
        lengths = rollout.batch["loss_mask"].sum(1)  # response tokens, <eos> included
        limit, buffer = cfg.rollout.max_new_tokens, cfg.task.overlong_buffer
        return overlong_penalty(lengths, limit, buffer, cfg.task.overlong_penalty)

    tracker, first_accuracy = start_tracking(cfg, dist_info, start_step, evaluate, t_setup)

    step, t_train, interrupted, metrics, extra = start_step, time.perf_counter(), False, {}, None
    with close_on_exit(sampler, prefetch), StopOnInterrupt(dist_info) as stop:
        for step in stop.steps(start_step + 1, cfg.train.steps + 1):  # an error names its step
            t0 = time.perf_counter()
            # 1. Sample a group of responses per prompt from the current policy (the loss's
            #    temperature, plain ancestral sampling); the batch carries the sampler's
            #    rollout_logprobs, which the engine compares with its own (mismatch/* metrics).
            #    A multi-turn task plays whole episodes instead (docs/rollouts.md).
            if prefetch is not None and cfg.rollout.dynamic_sampling:  # both: rounds ahead
                problems, rollout, scores, sampled = prefetch.take_groups(
                    step, dist_info, shaping=overlong
                )
            elif prefetch is not None:  # 1-2 sampled ahead by the worker (rollout.max_staleness)
                problems, rollout, scores = prefetch.take(step)
            elif cfg.rollout.dynamic_sampling:  # 1-2 until the groups' rewards differ (DAPO)
                problems, rollout, scores, sampled = dynamic_sample(
                    task, sampler, sampling, rng, prompts_per_rank, dist_info,
                    max_rounds=cfg.rollout.max_sampling_rounds, shaping=overlong,
                    limits=cfg.rollout,
                )  # fmt: skip
            else:
                problems = task.sample(rng, prompts_per_rank)
                # 2. Score: the task's reward (addition: exact match of the answer text only;
                #    episodes: the environments' rewards, summed over the turns).
                rollout, scores = sample_and_score(sampler, task, problems, sampling, cfg.rollout)
            if cfg.rollout.skip_env_errors:  # rows of failed episodes are gone: whole groups
                rollout, scores, problems = whole_groups(
                    rollout, scores, problems, cfg.rollout.group_size
                )
            # Built on the host, moved to the engine's device once: from here on every tensor
            # is the engine's (docs/batch.md#devices).
            rollout, scores = rollout.to(engine.device), scores.to(engine.device)
            batch = rollout.batch
            penalty = overlong(rollout)  # the reward trained on is scores + penalty
            # 3. Log-probs of the sampling policy (the ratio's anchor), recomputed by the engine
            #    unless actor.policy_loss.bypass_mode takes the sampler's own (hf: the very
            #    weights that sampled); and of the reference (the base model: the same engine
            #    with the LoRA adapter off), only when the KL is penalised or reported this step.
            old = None
            if not cfg.actor.policy_loss.bypass_mode:
                old = engine.infer_batch(batch)
                batch["old_logprobs"] = old["logprobs"]
            if cfg.train.kl_due(step, cfg.actor.policy_loss.kl_coef):
                with engine.disable_adapter():
                    batch["ref_logprobs"] = engine.infer_batch(batch)["logprobs"]
            # 4. Group-normalised advantages, spread onto the response tokens. A group is one
            #    prompt's rows, all sampled on this rank, so its statistics are complete here.
            check_whole_groups(rollout.group_ids, cfg.rollout.group_size)
            advantages, _ = grpo_advantages(scores + penalty, rollout.group_ids)
            batch["advantages"] = broadcast_to_tokens(advantages, batch["loss_mask"])
            # 5. PPO-style epochs over shuffled mini-batches; the engine splits each mini-batch
            #    into micro-batches and normalises the loss over the whole mini-batch.
            #    As many mini-batches on every rank, also when failed episodes left fewer rows.
            updates = []
            for _ in range(cfg.train.ppo_epochs):
                for rows in torch.randperm(batch.batch_size[0]).tensor_split(mini_batches):
                    updates.append(engine.train_batch(batch[rows]))
            is_eval_step = step % cfg.train.eval_every == 0 or step == cfg.train.steps
            if prefetch is not None:  # push (and check) the new weights; sample a step further
                prefetch.sync(engine)
            elif step % cfg.rollout.sync_every == 0 or is_eval_step:
                sampler.sync(engine)  # vllm: load the new weights; hf samples the live model
            # 6. Metrics (summed over ranks where they are counts), eval, checkpoint. The
            #    entropy comes from the old log-prob pass (none with the bypass), kl from the
            #    updates of a step with reference log-probs.
            sums = dist_info.sum(
                [
                    scores.sum().item(),
                    len(scores),
                    batch["attention_mask"].sum().item(),
                    0.0 if old is None else (old["entropy"] * batch["loss_mask"]).sum().item(),
                    batch["loss_mask"].sum().item(),
                    penalty.sum().item(),
                    batch["truncated"].sum().item(),
                ]
            )
            reward_sum, n_rows, n_tokens, entropy_sum, n_response, penalty_sum, n_cut = sums
            step_time = time.perf_counter() - t0
            metrics = {
                "reward": reward_sum / n_rows,
                **mean_metrics(updates),
                "response_tokens": n_response / n_rows,
                "truncated_frac": n_cut / n_rows,  # responses cut at max_new_tokens
                "tokens_per_s": n_tokens / step_time,
                "step_time": step_time,
            }
            if cfg.task.overlong_buffer:
                metrics["reward/overlong_penalty"] = penalty_sum / n_rows
            if cfg.rollout.dynamic_sampling:
                metrics.update(sampled)
            if episodes:
                metrics.update(episode_metrics(rollout, dist_info))
            if prefetch is not None:  # staleness/*, sync/probe_* (docs/rollouts.md)
                metrics.update(prefetch.metrics(step, rollout, dist_info))
            if old is not None:
                metrics["entropy"] = entropy_sum / max(n_response, 1.0)
            else:  # bypass: only the first update ran at the weights that sampled (docs/losses.md)
                metrics.update({k: v for k, v in updates[0].items() if k.startswith("mismatch/")})
            if is_eval_step:
                metrics["eval/accuracy"] = evaluate()
            tracker.log(step, metrics)
            # A few completions every output.log_samples_every steps (samples.jsonl, trackers).
            tracker.log_samples(step, sample_rows(rollout, problems, scores, tokenizer))
            if stop.should_stop():
                interrupted = True
                break
            if cfg.output.save_every and step % cfg.output.save_every == 0:
                save_run(
                    cfg.output.dir,
                    {"actor": engine},
                    step=step,
                    rng=rng,
                    dist_info=dist_info,
                    config=cfg,
                    extra_state=prefetch and prefetch.extra_state(),
                )
        extra = prefetch and prefetch.extra_state()  # the rollouts sampled ahead, for --resume

    return finish(
        cfg,
        {"actor": engine},
        tracker,
        step=step,
        start_step=start_step,
        rng=rng,
        dist_info=dist_info,
        interrupted=interrupted,
        first_accuracy=first_accuracy,
        last_metrics=metrics,
        train_time=time.perf_counter() - t_train,
        tokenizer=tokenizer,  # saved beside the merged model (output.export_merged)
        extra_state=extra,
    )


if __name__ == "__main__":
    sys.exit(main())

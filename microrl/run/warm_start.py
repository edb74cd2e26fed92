"""The supervised warm start of a toy base model: steps until its greedy accuracy reaches a target.

Both toy bases (the text one of :mod:`microrl.run.base_model`, the vision-language one of
:mod:`microrl.run.toy_vision`) train the same way: a full fine-tune with ``engine.sft_loss`` on
the batches their task makes, the greedy accuracy checked every ``model.warm_start.eval_every``
steps on training prompts, a stop at ``model.warm_start.target_accuracy`` (or
``max_steps``), then the model saved with its tokenizer last (a checkpoint counts as complete
only with it). Only how a batch is made, and what else is saved, differ.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.engine.checkpoint.export import export_merged_model
from microrl.rollout import HFRollout
from microrl.run.dist import Dist
from microrl.run.session import evaluate_accuracy

__all__ = ["train_to_target"]

#: Warm-start steps between two logged accuracy checks (the last and the reaching one always are).
LOG_EVERY = 100


def train_to_target(
    model: Any,
    tokenizer: Any,
    cfg: ModelConfig,
    task: Any,
    dist_info: Dist,
    *,
    make_batch: Callable[[random.Random, int], TensorDict],
    check_prompts: int,
    max_new_tokens: int,
    log: Callable[[str], None],
    image_encoder: Any = None,
    save_extra: Callable[[], None] | None = None,
) -> float:
    """Train ``model`` on ``make_batch(rng, rows)`` (``rows`` per rank) until the greedy accuracy
    on ``check_prompts`` training prompts reaches the target; save it to ``cfg.path`` (after
    ``save_extra``, the tokenizer last). ``image_encoder``: a vision-language model's, for its
    greedy checks. Returns the last accuracy."""
    ws = cfg.warm_start
    if ws.batch_size % dist_info.world_size:
        raise ValueError(
            f"model.warm_start.batch_size={ws.batch_size} must be divisible by the "
            f"{dist_info.world_size} processes"
        )
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"no checkpoint at {cfg.path}: warm-starting a {n_params / 1e3:.0f}k-parameter "
        f"{type(model).__name__} with supervised steps until {ws.target_accuracy:.0%} greedy "
        f"accuracy (checked every {ws.eval_every} steps, <= {ws.max_steps} steps)"
    )
    rows = ws.batch_size // dist_info.world_size
    engine = ActorEngine(
        model,
        ActorConfig(
            micro_batch_size=rows,
            optim=OptimConfig(lr=ws.lr, grad_clip=1.0),
            lora=LoraConfig(rank=0),  # full fine-tune: this *is* the base model
            seed=cfg.seed,
        ),
    )
    sampler = HFRollout(engine, tokenizer, image_encoder=image_encoder)
    rng = random.Random(cfg.seed * 1000 + dist_info.rank)
    check = dist_info.shard(task.sample(random.Random(cfg.seed + 1), check_prompts))
    start, accuracy = time.perf_counter(), 0.0
    for step in range(1, ws.max_steps + 1):
        metrics = engine.train_batch(make_batch(rng, rows), loss_fn=engine.sft_loss)
        if step % ws.eval_every == 0 or step == ws.max_steps:
            accuracy = evaluate_accuracy(sampler, task, check, dist_info, max_new_tokens)
            reached = accuracy >= ws.target_accuracy
            if reached or step % LOG_EVERY == 0 or step == ws.max_steps:
                log(
                    f"  warm-start step {step:4d}  sft_loss {metrics['sft_loss']:.3f}  "
                    f"accuracy {accuracy:.3f}  ({time.perf_counter() - start:.0f}s)"
                )
            if reached:
                break
    else:
        log(
            f"  the warm start stopped at model.warm_start.max_steps={ws.max_steps} below "
            f"model.warm_start.target_accuracy={ws.target_accuracy}: a weaker base than intended"
        )
    export_merged_model(engine.module, cfg.path)
    if dist_info.is_main:
        if save_extra is not None:
            save_extra()
        tokenizer.save_pretrained(cfg.path)  # last: a checkpoint counts as complete only with it
    dist_info.barrier()
    log(
        f"saved the base model to {cfg.path} ({time.perf_counter() - start:.0f}s, "
        f"accuracy {accuracy:.3f})"
    )
    return accuracy

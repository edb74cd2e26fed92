"""The base model RL starts from: a local checkpoint, or a tiny model warm-started here once.

When ``model.path`` holds no checkpoint and the task is one the toy model can learn (a task with a
``toy_alphabet``: the built-in ``addition`` and ``word_problems``), a fresh model is built
(:mod:`microrl.run.toy_model`, its character tokenizer extended by the task's alphabet) and trained
with the engine's supervised loss (:meth:`ActorEngine.sft_loss`, full fine-tune) until its greedy
accuracy on training prompts reaches ``warm_start.target_accuracy``. A *partly* trained base leaves
RL visible room to improve. The result (model + tokenizer) is saved to ``model.path`` and reused by
every later run, including the other example.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.run import ModelConfig, TaskConfig
from microrl.engine import ActorEngine
from microrl.engine.checkpoint.export import export_merged_model
from microrl.engine.rollout import HFRollout, sft_batch
from microrl.run.dist import Dist
from microrl.run.session import evaluate_accuracy
from microrl.run.toy_model import build_model, build_tokenizer, is_checkpoint, load_tokenizer
from microrl.tasks.base import Task
from microrl.tasks.factory import BUILT_IN_TASKS, make_task

__all__ = ["prepare_base_model"]

# Warm-start accuracy is measured on this many *training* prompts: the held-out set is kept for RL.
WARM_START_EVAL_PROMPTS = 200


def prepare_base_model(
    cfg: ModelConfig,
    task_cfg: TaskConfig,
    dist_info: Dist,
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> tuple[PreTrainedTokenizerBase, str]:
    """Tokenizer and checkpoint path ``cfg.path``, warm-starting and saving a model there first if
    needed. The engines load the path themselves: under torchrun only rank 0 reads it
    (microrl/engine/parallel/materialize.py).

    Only a task with a ``toy_alphabet`` gets a model built for it; for any other (a
    ``task.name=dataset`` file), an empty ``model.path`` is a ``ValueError``.
    """
    if not is_checkpoint(cfg.path):
        task = make_task(task_cfg) if task_cfg.name in BUILT_IN_TASKS else None
        if getattr(task, "toy_alphabet", None) is None:
            raise ValueError(
                f"model.path={cfg.path!r} holds no transformers checkpoint (config.json and a "
                "tokenizer), and a base model is built and warm-started here only for the "
                f"built-in tasks ({', '.join(BUILT_IN_TASKS)}): for task.name={task_cfg.name} "
                "give model.path a local checkpoint (docs/tasks.md)"
            )
        _warm_start(cfg, task, dist_info, max_new_tokens, log)
    return load_tokenizer(cfg.path), cfg.path


def _warm_start(
    cfg: ModelConfig,
    task: Task,
    dist_info: Dist,
    max_new_tokens: int,
    log: Callable[[str], None],
) -> None:
    ws = cfg.warm_start
    tokenizer = build_tokenizer(task.toy_alphabet)
    longest = max(len(tokenizer(p.prompt)["input_ids"]) for p in task.eval_problems())
    if longest + max_new_tokens > cfg.max_positions:
        raise ValueError(
            f"model.max_positions must be >= {longest + max_new_tokens} for this task (its "
            f"longest prompt has {longest} tokens, plus rollout.max_new_tokens={max_new_tokens}), "
            f"got {cfg.max_positions}"
        )
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"no checkpoint at {cfg.path}: warm-starting a {n_params / 1e3:.0f}k-parameter {type(model).__name__} "
        f"with supervised steps until {ws.target_accuracy:.0%} accuracy (<= {ws.max_steps} steps)"
    )
    if ws.batch_size % dist_info.world_size:
        raise ValueError(
            f"model.warm_start.batch_size={ws.batch_size} must be divisible by the "
            f"{dist_info.world_size} processes"
        )
    per_rank = ws.batch_size // dist_info.world_size
    engine = ActorEngine(
        model,
        ActorConfig(
            micro_batch_size=per_rank,
            optim=OptimConfig(lr=ws.lr, grad_clip=1.0),
            lora=LoraConfig(rank=0),  # full fine-tune: this *is* the base model
            seed=cfg.seed,
        ),
    )
    sampler = HFRollout(engine, tokenizer)
    rng = random.Random(cfg.seed * 1000 + dist_info.rank)
    check = dist_info.shard(task.sample(random.Random(cfg.seed + 1), WARM_START_EVAL_PROMPTS))
    start = time.perf_counter()
    accuracy = 0.0
    for step in range(1, ws.max_steps + 1):
        problems = task.sample(rng, per_rank)
        batch = sft_batch(tokenizer, [p.prompt for p in problems], [p.answer for p in problems])
        metrics = engine.train_batch(batch, loss_fn=engine.sft_loss)
        if step % ws.eval_every == 0 or step == ws.max_steps:
            accuracy = evaluate_accuracy(sampler, task, check, dist_info, max_new_tokens)
            log(
                f"  warm-start step {step:4d}  sft_loss {metrics['sft_loss']:.3f}  "
                f"accuracy {accuracy:.3f}  ({time.perf_counter() - start:.0f}s)"
            )
            if accuracy >= ws.target_accuracy:
                break
    export_merged_model(engine.module, cfg.path)
    if dist_info.is_main:
        tokenizer.save_pretrained(cfg.path)  # last: a checkpoint counts as complete only with it
    dist_info.barrier()
    log(
        f"saved the base model to {cfg.path} ({time.perf_counter() - start:.0f}s, accuracy {accuracy:.3f})"
    )

"""The base model RL starts from: a local checkpoint, a Hub model, or a toy model built once.

``model.path`` that is not a local directory but a Hugging Face Hub id is downloaded into the
Hugging Face cache, and its snapshot directory is the checkpoint. When ``model.path`` is one of
the examples' own toy-model paths (or ``model.build_toy`` is set), holds no checkpoint, and the
task is one the toy model can learn (a task with a ``toy_alphabet``: the built-in ``addition``,
``word_problems`` and ``calculator``), a fresh model of ``model.toy_arch`` (dense, or a mixture
of experts at ``<path>-moe``) is built (:mod:`microrl.run.toy_model`, its
character tokenizer extended by the task's alphabet, and by a tool task's whole tokens and chat
template; a tool task learns from its ``warm_start_conversations``, a share
``warm_start.tool_share`` of them through the tool, and is checked on its greedy first turn) and
trained
with the engine's supervised loss (:meth:`ActorEngine.sft_loss`, full fine-tune) until its greedy
accuracy on training prompts reaches ``warm_start.target_accuracy``. A *partly* trained base leaves
RL visible room to improve. The toy model learns addition in a sudden jump whose step moves by
hundreds with the last bits of rounding (another CPU, a tiny perturbation of the initial weights),
so a fixed step count would land anywhere on the jump; the accuracy is therefore checked often
(every ``warm_start.eval_every`` steps, on :data:`WARM_START_EVAL_PROMPTS` prompts) and the stop
lands just above the target wherever the jump comes. The result (model + tokenizer) is saved to
``model.path`` and reused by every later run, including the other example.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from microrl.configs.judge import JudgeConfig
from microrl.configs.run import AGENT_TASK_NAMES, ModelConfig, TaskConfig
from microrl.configs.task_sections import AgentConfig, RewardModelConfig
from microrl.engine.memory_activations import moe_experts
from microrl.engine.parallel.nodes import SEVERAL_NODES_DOC, gather_with_hosts, list_ranks
from microrl.hub import download_on_main, is_hub_name
from microrl.run.dist import Dist
from microrl.run.toy_model import build_model, build_tokenizer, is_checkpoint, load_tokenizer
from microrl.run.warm_start import train_to_target
from microrl.tasks.base import Problem, Task
from microrl.tasks.factory import BUILT_IN_TASKS, make_task

__all__ = ["prepare_base_model"]

# Warm-start accuracy is measured on this many *training* prompts (the held-out set is kept for RL):
# enough that its noise (about 0.02) stays below the step of the accuracy between two checks.
WARM_START_EVAL_PROMPTS = 500


def _without_models(task_cfg: TaskConfig) -> TaskConfig:
    """``task_cfg`` without its reward model and judge: the warm start's accuracy checks score
    thousands of greedy answers, which only the task's own (or its functions') reward should."""
    if not (task_cfg.reward_model.enabled or task_cfg.judge.enabled):
        return task_cfg
    rewards = task_cfg.rewards
    weights = rewards.weights[: len(rewards.functions)]
    return dataclasses.replace(
        task_cfg,
        rewards=dataclasses.replace(rewards, weights=weights),
        reward_model=RewardModelConfig(),
        judge=JudgeConfig(),
    )


def prepare_base_model(
    cfg: ModelConfig,
    task_cfg: TaskConfig,
    dist_info: Dist,
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> tuple[PreTrainedTokenizerBase, str]:
    """Tokenizer and local checkpoint directory of the base model ``cfg.path`` names:

    - a local transformers checkpoint: as it is;
    - one of the examples' :data:`~microrl.configs.run.TOY_MODEL_PATHS`, or any path with
      ``model.build_toy``: the toy model of ``model.toy_arch`` built, warm-started and saved there
      first (only for a task with a ``toy_alphabet``; for any other, such as a
      ``task.name=dataset`` file, a ``ValueError``); at the examples' paths a mixture-of-experts
      toy lives beside the dense one, at ``<path>-moe`` (:meth:`ModelConfig.toy_path`, the
      directory returned);
    - a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``; :func:`microrl.hub.is_hub_name`):
      its snapshot in the Hugging Face cache, downloaded by rank 0 first.

    Anything else (a missing local path, a failed download, ``model.toy_arch=moe`` with a
    checkpoint that has no experts or a Hub id) is a one-line ``ValueError`` that says how to get
    the model. The engines load the returned directory themselves: under
    torchrun only rank 0 reads it (engine/parallel/materialize.py).
    """
    toy_path = cfg.toy_path()
    path = toy_path or cfg.path
    found = is_checkpoint(path)
    _check_same_on_every_node(path, found, "holds a checkpoint (config.json and a tokenizer)")
    if found:
        _check_toy_arch(cfg, path)
        return load_tokenizer(path), path
    if toy_path is not None:
        cfg = dataclasses.replace(cfg, path=toy_path)
        # The warm start teaches the task's prompts, also those an agent plays (task.agent).
        task = _plain_task(task_cfg)
        if getattr(task, "toy_alphabet", None) is None:
            raise ValueError(
                f"model.path={path!r} holds no transformers checkpoint (config.json and a "
                "tokenizer), and a toy base model is built and warm-started only for the "
                f"built-in tasks ({', '.join(BUILT_IN_TASKS)}): for task.name={task_cfg.name} "
                "give model.path a local checkpoint or a Hugging Face Hub id (docs/tasks.md)"
            )
        if getattr(task, "image_size", None):  # image prompts: the vision-language toy
            if cfg.toy_arch != "dense":
                raise ValueError(
                    f"model.toy_arch must be dense for task.name={task_cfg.name}, got "
                    f"{cfg.toy_arch!r}: its toy base is a vision-language model (docs/tasks.md)"
                )
            from microrl.run.toy_vision import warm_start_vision

            warm_start_vision(cfg, task, dist_info, max_new_tokens, log)
        else:
            _warm_start(cfg, task, dist_info, max_new_tokens, log)
        _check_same_on_every_node(path, is_checkpoint(path), "holds the base model rank 0 built")
        return load_tokenizer(path), path
    if is_hub_name(path):
        if cfg.toy_arch != "dense":
            raise ValueError(
                f"model.toy_arch={cfg.toy_arch!r} chooses the architecture of a toy base, but "
                f"model.path={path!r} names a Hugging Face Hub model: leave model.toy_arch=dense"
            )
        path = download_on_main(path, "model.path", dist_info, log)
        return load_tokenizer(path), path
    what = "holds no transformers checkpoint (config.json and a tokenizer)"
    raise ValueError(
        f"model.path={path!r} {what if os.path.isdir(path) else 'does not exist'}: give a local "
        "checkpoint directory, a Hugging Face Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct), or "
        "model.build_toy=true to build a toy model there; to download a Hub model into it: "
        f"`hf download <org/name> --local-dir {path}`"
    )


def _check_toy_arch(cfg: ModelConfig, path: str) -> None:
    """``ValueError`` naming ``model.toy_arch`` when it asks for a mixture of experts and the
    checkpoint at ``path`` has none: a dense checkpoint would train in its place, unnoticed
    (``dense``, the default, takes any checkpoint)."""
    if cfg.toy_arch == "dense":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if moe_experts(getattr(config, "text_config", config))[0]:
        return
    raise ValueError(
        f"model.toy_arch={cfg.toy_arch!r}, but model.path={cfg.path!r} holds a checkpoint "
        f"without experts at {path} ({type(config).__name__}): give model.path a new directory "
        "to build the mixture-of-experts toy there (with model.build_toy=true)"
    )


def _check_same_on_every_node(path: str, found: bool, what: str) -> None:
    """Collective: a ``ValueError`` on every rank when ``path`` holds a checkpoint for some
    ranks only (another node's disk), rather than those ranks failing alone, or building a toy
    model the others skip, while the rest wait in a collective."""
    views = gather_with_hosts(found)
    if all(seen == views[0][0] for seen, _ in views):
        return
    have = [(rank, host) for rank, (seen, host) in enumerate(views) if seen]
    lack = [(rank, host) for rank, (seen, host) in enumerate(views) if not seen]
    raise ValueError(
        f"model.path={path!r} {what} for {list_ranks(have)}, but not for {list_ranks(lack)}: "
        "across nodes it must be on a file system every node mounts, or copied to the same "
        f"path on every node ({SEVERAL_NODES_DOC})"
    )


def _plain_task(task_cfg: TaskConfig) -> Task | None:
    """The built-in task ``task_cfg`` names without its agent, reward model and judge (None for
    another task): the warm start teaches its prompts, also those an agent plays."""
    if task_cfg.name not in BUILT_IN_TASKS:
        return None
    if task_cfg.name in AGENT_TASK_NAMES:  # played only by an agent: its own prompts and reward
        return BUILT_IN_TASKS[task_cfg.name](
            task_cfg.operand_limit, task_cfg.eval_size, task_cfg.seed
        )
    return make_task(dataclasses.replace(_without_models(task_cfg), agent=AgentConfig()))


class _FirstTurn:
    """A tool task's warm-start check (the calculator's): training prompts rendered as an
    agent's first call renders them (chat template, tools), the greedy first turn scored by
    ``first_turn_score`` (a right answer, or a call whose result is the sum)."""

    def __init__(self, task: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.solved_threshold = task.solved_threshold
        self.toy_alphabet = task.toy_alphabet

    def _rendered(self, problems: Sequence[Problem]) -> list[Problem]:
        render = self.task.render_prompt
        return [dataclasses.replace(p, prompt=render(self.tokenizer, p.prompt)) for p in problems]

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self._rendered(self.task.sample(rng, n))

    def eval_problems(self) -> list[Problem]:
        return self._rendered(self.task.eval_problems())

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        return self.task.first_turn_score(responses, problems)


class _SingleTurn:
    """A task's prompts, answers and reward without its environments (``make_env``): the warm
    start teaches and checks one-turn answers, so ``hinted_addition`` starts from the very base
    model ``addition`` builds."""

    def __init__(self, task: Task) -> None:
        self.solved_threshold = task.solved_threshold
        self.toy_alphabet = task.toy_alphabet
        self.sample, self.eval_problems, self.score = task.sample, task.eval_problems, task.score


def _warm_start(
    cfg: ModelConfig,
    task: Task,
    dist_info: Dist,
    max_new_tokens: int,
    log: Callable[[str], None],
) -> None:
    ws = cfg.warm_start
    # A tool task (the calculator) brings its chat template, its whole tokens and conversations
    # to learn from, a share ws.tool_share of them solved through the tool.
    conversations = getattr(task, "warm_start_conversations", None)
    tokenizer = build_tokenizer(task.toy_alphabet, getattr(task, "toy_tokens", ()))
    if conversations is not None:
        tokenizer.chat_template = task.chat_template
        tools = list(task.tools)
        task = _FirstTurn(task, tokenizer)
        # The longest row an agent's episode makes: a call, the tool's result, the answer.
        row = conversation_sft_batch(tokenizer, conversations(random.Random(0), 8, 1.0), tools)
        if row["input_ids"].shape[1] > cfg.max_positions:
            raise ValueError(
                f"model.max_positions must be >= {row['input_ids'].shape[1]} for this task (an "
                f"episode that calls the tool), got {cfg.max_positions}"
            )
    else:
        task = _SingleTurn(task)  # a multi-turn task's base learns its prompts' answers in one turn
    longest = max(len(tokenizer(p.prompt)["input_ids"]) for p in task.eval_problems())
    if longest + max_new_tokens > cfg.max_positions:
        raise ValueError(
            f"model.max_positions must be >= {longest + max_new_tokens} for this task (its "
            f"longest prompt has {longest} tokens, plus rollout.max_new_tokens={max_new_tokens}), "
            f"got {cfg.max_positions}"
        )
    model = build_model(cfg, tokenizer)

    def make_batch(rng: random.Random, rows: int) -> TensorDict:
        if conversations is not None:
            return conversation_sft_batch(tokenizer, conversations(rng, rows, ws.tool_share), tools)
        problems = task.sample(rng, rows)
        return sft_batch(tokenizer, [p.prompt for p in problems], [p.answer for p in problems])

    train_to_target(
        model,
        tokenizer,
        cfg,
        task,
        dist_info,
        make_batch=make_batch,
        check_prompts=WARM_START_EVAL_PROMPTS,
        max_new_tokens=max_new_tokens,
        log=log,
    )


def sft_batch(tokenizer, prompts: Sequence[str], answers: Sequence[str]) -> TensorDict:
    """Teacher-forcing rows ``prompt + answer + <eos>``, loss on ``answer + <eos>`` (``[B, T]``)."""
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(
            f"need as many answers as prompts (>0), got {len(prompts)}, {len(answers)}"
        )
    rows, masks = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        p = tokenizer(prompt)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    return _padded_batch(rows, masks, tokenizer.pad_token_id)


def conversation_sft_batch(
    tokenizer, conversations: Sequence[Sequence[dict]], tools: Sequence[dict] | None = None
) -> TensorDict:
    """Teacher-forcing rows of whole chat conversations rendered by the tokenizer's chat
    template (with ``tools``), loss on every assistant turn: its content, its tool calls and
    its turn end, as the template writes them (``[B, T]``). Users', tools' messages and the
    assistant headers are context. E.g. the calculator task's warm start
    (:meth:`microrl.tasks.calculator.CalculatorTask.warm_start_conversations`).

    Raises ``ValueError`` when the template renders an earlier turn differently once later
    turns follow (an assistant turn could not be isolated), or a turn's tokens change with them.
    """
    if not conversations:
        raise ValueError("need at least one conversation")
    rows, masks = [], []
    for messages in conversations:
        ids, mask = _conversation_row(tokenizer, list(messages), list(tools) if tools else None)
        rows.append(ids)
        masks.append(mask)
    return _padded_batch(rows, masks, tokenizer.pad_token_id)


def _conversation_row(tokenizer, messages: list[dict], tools) -> tuple[list[int], list[int]]:
    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    full = render(len(messages), False)
    ids = encode(full)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(index, True), render(index + 1, False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ValueError(
                "the chat template renders a conversation's earlier turns differently once later "
                f"turns follow (at message {index}): its assistant turns cannot be isolated"
            )
        start, stop = len(encode(before)), len(encode(through))
        if ids[:stop] != encode(through):
            raise ValueError(
                f"the tokens of a conversation's turns up to message {index} change once later "
                "turns follow: its assistant turns cannot be isolated"
            )
        mask[start:stop] = [1] * (stop - start)
    return ids, mask


def _padded_batch(rows: list[list[int]], masks: list[list[int]], pad: int) -> TensorDict:
    width = max(len(r) for r in rows)
    # Right padding here: the engine takes any padding, and nothing is generated from these rows.
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor(
        [[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool
    )
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    return TensorDict(
        {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask},
        batch_size=[len(rows)],
    )

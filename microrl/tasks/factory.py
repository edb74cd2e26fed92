"""The task a recipe trains on, from its ``task`` config section (docs/tasks.md).

``task.name`` picks one of :data:`BUILT_IN_TASKS` (generated prompts with their own reward),
``dataset`` (the user's prompt file, ``task.dataset``, scored by the reward functions in
``task.rewards.functions``) or
``env`` (the prompt file played against the environments of ``task.env``). Reward functions
given for a built-in task replace its own reward.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

from microrl.configs.run import TaskConfig
from microrl.tasks.addition import AdditionTask
from microrl.tasks.agents import AgentTask
from microrl.tasks.base import Task
from microrl.tasks.calculator import CalculatorTask
from microrl.tasks.dataset import DatasetTask
from microrl.tasks.digits import DigitsTask
from microrl.tasks.environments import EnvTask, HintedAdditionTask
from microrl.tasks.rewards import Reward, RewardedTask, resolve_reward_fn
from microrl.tasks.word_problems import WordProblemTask

__all__ = [
    "BUILT_IN_TASKS",
    "check_round_trip",
    "check_tokenizer_covers",
    "make_task",
    "reward_of",
    "tool_parser_of",
]

# name -> class, constructed as cls(task.operand_limit, task.eval_size, task.seed).
BUILT_IN_TASKS: dict[str, type[AdditionTask | WordProblemTask | CalculatorTask | DigitsTask]] = {
    "addition": AdditionTask,
    "word_problems": WordProblemTask,
    "hinted_addition": HintedAdditionTask,
    "calculator": CalculatorTask,  # played by an agent only (task.agent, AGENT_TASK_NAMES)
    "digits": DigitsTask,  # image prompts: read the number drawn (a vision-language policy)
}
# The tool-call parser of a built-in agent task whose task.agent.tool_parser is unset.
DEFAULT_TOOL_PARSERS = {"calculator": "hermes"}
# Held-out prompts whose tokenization is checked: no unknown token, and decoded back to the text.
_CHECKED_PROMPTS = 64


def make_task(cfg: TaskConfig, tokenizer: Any = None, *, engine_config: Any = None) -> Task:
    """The task ``cfg`` describes; ``tokenizer`` (the policy's) renders chat templates and is
    checked to write the task's prompts without unknown tokens. ``engine_config``: the run's
    (the actor's) :class:`~microrl.configs.EngineConfig`, whose precision rules a reward model
    follows (None: the defaults).

    Raises ``ValueError``/``TypeError`` naming the ``task.*`` key of a bad file, field, reward
    path or size.
    """
    data = cfg.dataset
    if cfg.name in ("dataset", "env"):
        task: Task = DatasetTask(
            data.train_file,
            # None: an agent returns the reward itself (a transcript is then refused)
            reward_of(cfg, engine_config=engine_config)
            if cfg.name == "dataset" and cfg.reward_terms()
            else None,
            eval_file=data.eval_file,
            eval_size=cfg.eval_size,
            seed=cfg.seed,
            prompt_field=data.prompt_field,
            answer_field=data.answer_field,
            chat_template=data.chat_template,
            tokenizer=tokenizer,
            solved_threshold=cfg.solved_threshold,
            dataset_config=data.config,
            train_split=data.train_split,
            eval_split=data.eval_split,
            image_field=cfg.images.field,
            image_marker=cfg.images.marker,
        )
        if cfg.name == "env":  # the prompts played against the environments task.env builds
            task = EnvTask(task, resolve_reward_fn(cfg.env, "task.env"), cfg.solved_threshold)
    else:
        task = BUILT_IN_TASKS[cfg.name](cfg.operand_limit, cfg.eval_size, cfg.seed)
        if cfg.reward_terms():
            task = RewardedTask(
                task, reward_of(cfg, engine_config=engine_config), cfg.solved_threshold
            )
    if tokenizer is not None:
        check_tokenizer_covers(tokenizer, task, cfg.name)
    agent = cfg.agent
    if agent.enabled:  # the prompts played by the user's agent through the endpoint
        if getattr(getattr(task, "reward", None), "collective", False):
            raise ValueError(
                "task.reward_model under torchrun cannot score task.agent's episodes: the "
                "sharded reward model needs every rank in each forward, while each rank scores "
                "its agents' episodes one at a time; run on one process or unset one of them"
            )
        task = AgentTask(
            task,
            resolve_reward_fn(agent.function, "task.agent.function"),
            timeout_s=agent.timeout_s,
            max_concurrency=agent.max_concurrency,
            host=agent.host,
            tool_parser=tool_parser_of(cfg, tokenizer),
            scores_transcripts=cfg.name != "dataset" or bool(cfg.reward_terms()),
        )
    return task


def tool_parser_of(cfg: TaskConfig, tokenizer: Any = None) -> Any:
    """The parser ``task.agent.tool_parser`` names (unset: the task's default, hermes for the
    calculator, else None: content only). ``ValueError`` naming the key and listing the known
    names for an unknown one (vLLM's too where it is installed)."""
    name = cfg.agent.tool_parser or DEFAULT_TOOL_PARSERS.get(cfg.name)
    if name is None:
        return None
    from microrl.agents.tool_parsers import make_tool_parser

    try:
        return make_tool_parser(name, tokenizer)
    except ValueError as err:
        raise ValueError(f"task.agent.tool_parser={name!r}: {err}") from err


def reward_of(cfg: TaskConfig, *, engine_config: Any = None) -> Reward:
    """The weighted sum of ``cfg``'s reward terms: ``task.rewards.functions`` (import paths),
    then the reward model (``task.reward_model``, under ``engine_config``'s precision rules) and
    the LLM judge (``task.judge``) when set, weighted by ``task.rewards.weights`` in that order
    (docs/tasks.md#reward-models)."""
    fns: list[Any] = list(cfg.rewards.functions)
    model = cfg.reward_model
    if model.enabled:
        from microrl.tasks.reward_model import RewardModelScorer  # torch + transformers: on use

        fns.append(
            RewardModelScorer(
                model.path,
                base=model.base,
                batch_size=model.batch_size,
                norm=model.norm,
                chat_template=model.chat_template,
                engine_config=engine_config,
            )
        )
    if cfg.judge.enabled:
        from microrl.tasks.judge import JudgeReward

        fns.append(JudgeReward(cfg.judge))
    return Reward(fns, cfg.rewards.weights)


def check_tokenizer_covers(tokenizer: Any, task: Task, name: str = "") -> None:
    """``ValueError`` when ``tokenizer`` turns some of the task's prompts into unknown tokens
    (e.g. word problems given the addition model's character tokenizer), or does not decode a
    prompt back to its text (:func:`check_round_trip`)."""
    prompts = [p.prompt for p in task.eval_problems()[:_CHECKED_PROMPTS]]
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None:
        for prompt, ids in zip(prompts, tokenizer(prompts)["input_ids"], strict=True):
            if unk in ids:
                unknown = sorted({c for c in prompt if tokenizer.convert_tokens_to_ids(c) == unk})
                raise ValueError(
                    f"the model's tokenizer cannot write the prompts of task.name={name or '?'}: "
                    f"{prompt!r} has unknown characters {''.join(unknown)!r}. Give model.path a "
                    "checkpoint whose tokenizer covers them (for a built-in task, an empty "
                    "directory: a toy model is built there for it)"
                )
    check_round_trip(tokenizer, prompts)


def check_round_trip(tokenizer: Any, texts: Sequence[str]) -> None:
    """``ValueError`` naming the tokenizer's path when one of ``texts`` does not come back from
    encode -> decode, up to what tokenizers legitimately normalise (Unicode NFKC, runs of
    whitespace, a leading or trailing space, spaces beside a special token).

    Why: transformers 5 loads a custom tokenizer saved beside e.g. a Qwen2 ``config.json`` as that
    model type's own class, which can silently drop the spaces; no token is unknown then.
    """
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t.strip()]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if _comparable(back, specials) != _comparable(text, specials):
            path = getattr(tokenizer, "name_or_path", "") or "?"
            raise ValueError(
                f"the tokenizer loaded from model.path={path!r} ({type(tokenizer).__name__}) does "
                f"not decode the prompts it encodes back to their text: {text!r} comes back as "
                f"{back!r}. transformers 5 loads its own tokenizer class for some model types "
                "(config.json's model_type, e.g. qwen2), whatever class tokenizer_config.json "
                "names: a custom tokenizer saved beside such a config is replaced. Give "
                "model.path a checkpoint whose tokenizer writes its prompts (docs/tasks.md#models)"
            )


def _comparable(text: str, specials: Sequence[str]) -> str:
    text = " ".join(unicodedata.normalize("NFKC", text).split())
    for token in specials:  # a sentencepiece tokenizer may add a space after one
        text = token.join(part.strip() for part in text.split(token))
    return text

"""What composes: every rule that ties keys of two config sections, in one table.

A section checks its own keys (types, ranges, and rules among its own keys) in its
``__post_init__``. A rule that ties two sections -- ``task.name`` and ``task.dataset``, an agent
and the environments, the vLLM servers and the synchronous loop, a teacher and multi-turn tasks,
a recipe and what it cannot train -- is a :class:`Refusal` row of :data:`REFUSALS`: the key it
names, what that key must be, why, and which recipes it binds. The sections and the recipes'
configs check their rows (:func:`check_refusals`); docs/recipes.md#what-composes is rendered from
this table (:func:`refusals_markdown`, ``python -m microrl.configs.refusals``), and a test keeps
it current.

Each row's ``scope`` says where it is checked and what its predicate gets:

- ``task``, ``rollout``, ``teacher``: that section, when it is built (also outside a recipe);
- ``recipe``: the recipe's whole config, when it is built (``recipes``: which);
- ``images``: the recipe's config when the run starts and its task gives prompts with images
  (``facts["vllm_vision"]``: why vLLM cannot sample them on this machine, or None).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from microrl.configs.task_names import AGENT_TASK_NAMES, EPISODE_TASK_NAMES, FILE_TASK_NAMES

__all__ = [
    "RECIPES",
    "REFUSALS",
    "Refusal",
    "check_refusals",
    "check_vllm_servers",
    "refusals_markdown",
]

RECIPES = ("grpo", "ppo")
# The part of a key's path that names the object a scope's predicate gets.
_SCOPE_PREFIX = {"task": "task.", "rollout": "rollout.", "teacher": "teacher."}
_SCOPES = ("task", "rollout", "teacher", "recipe", "images")

Facts = Mapping[str, Any]


@dataclass(frozen=True)
class Refusal:
    """One rule: ``key`` must be ``must`` (because ``why``) whenever ``refused`` is false.

    ``refused(obj, facts)``: whether the config ``obj`` (the scope's section or recipe config)
    breaks the rule; ``detail(obj, facts)``: what the error adds to ``must`` (a computed bound).
    """

    key: str
    must: str
    why: str
    refused: Callable[[Any, Facts], bool]
    scope: str = "recipe"
    recipes: tuple[str, ...] = RECIPES
    detail: Callable[[Any, Facts], str] | None = None

    def error(self, obj: Any, facts: Facts) -> ValueError:
        """``"<key> must be <must> (<why>), got <value>"``: the form the loader reads the key of."""
        extra = self.detail(obj, facts) if self.detail is not None else ""
        value = _value(obj, self.key.removeprefix(_SCOPE_PREFIX.get(self.scope, "")))
        return ValueError(f"{self.key} must be {self.must}{extra} ({self.why}), got {value!r}")


def _value(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return getattr(obj, "value", obj)  # an enum by its value, as a config writes it


def _local_servers(rollout: Any) -> bool:
    """Whether microrl starts vLLM servers (asynchronous vllm, no server of the user's)."""
    return rollout.backend == "vllm" and rollout.max_staleness >= 1 and not rollout.server.url


def _kl_used(c: Any) -> bool:
    return c.actor.policy_loss.kl_coef != 0 or c.train.kl_metric_every != 0


_FILE_TASKS = " or ".join(FILE_TASK_NAMES)
_EPISODE_TASKS = " or ".join(EPISODE_TASK_NAMES)

REFUSALS: tuple[Refusal, ...] = (
    # ---- task: task.name and the sections it nests
    Refusal(
        "task.dataset.train_file",
        f"a .jsonl or .parquet file or a Hub dataset name for task.name={_FILE_TASKS}",
        "their prompts are its rows",
        lambda t, _: t.name in FILE_TASK_NAMES and not t.dataset.train_file,
        "task",
    ),
    *(
        Refusal(
            f"task.dataset.{key}",
            f"null unless task.name={_FILE_TASKS}",
            "the built-in tasks make their own prompts: set task.name=dataset to train on a file",
            lambda t, _, key=key: (
                t.name not in FILE_TASK_NAMES and getattr(t.dataset, key) is not None
            ),
            "task",
        )
        for key in ("train_file", "eval_file")
    ),
    Refusal(
        "task.images.field",
        "null unless task.name=dataset",
        "only a dataset's rows hold images; task.name=digits draws its own",
        lambda t, _: t.images.field is not None and t.name != "dataset",
        "task",
    ),
    Refusal(
        "task.env",
        "an environment factory (module:function) for task.name=env, and null otherwise",
        "the env task plays the dataset's prompts against the environments it builds",
        lambda t, _: (t.name == "env") != bool(t.env),
        "task",
    ),
    Refusal(
        "task.rewards.functions",
        "a non-empty list of reward functions for task.name=dataset, e.g. [my_reward:score] or "
        "[microrl.tasks.rewards:exact_match], unless task.reward_model.path, task.judge.url or "
        "a task.agent.function that returns the reward is set",
        "a dataset has no reward of its own",
        lambda t, _: t.name == "dataset" and not t.reward_terms() and not t.agent.enabled,
        "task",
    ),
    Refusal(
        "task.rewards.weights",
        "empty or one weight per reward term",
        "they weigh task.rewards.functions, task.reward_model and task.judge, in that order",
        lambda t, _: bool(t.rewards.weights) and len(t.rewards.weights) != len(t.reward_terms()),
        "task",
        detail=lambda t, _: f" ({len(t.reward_terms())}: {', '.join(t.reward_terms()) or 'none'})",
    ),
    Refusal(
        "task.agent.function",
        f"null for task.name={_EPISODE_TASKS}",
        "their environments play the episodes",
        lambda t, _: t.agent.enabled and t.name in EPISODE_TASK_NAMES,
        "task",
    ),
    Refusal(
        "task.agent.function",
        "an agent (module:function or file.py:function) for task.name="
        + " or ".join(AGENT_TASK_NAMES)
        + ", e.g. examples/calculator_agent.py:agent",
        "an agent plays that task, nothing else does",
        lambda t, _: t.name in AGENT_TASK_NAMES and not t.agent.enabled,
        "task",
    ),
    *(
        Refusal(
            f"task.{key}",
            f"empty with task.name={_EPISODE_TASKS}",
            "their environments give the rewards",
            lambda t, _, section=section: (
                t.name in EPISODE_TASK_NAMES and getattr(t, section).enabled
            ),
            "task",
        )
        for section, key in (("reward_model", "reward_model.path"), ("judge", "judge.url"))
    ),
    # ---- rollout: the backends, the servers and the synchronous loop
    Refusal(
        "rollout.server.url",
        "empty unless rollout.backend=vllm",
        "vLLM servers sample for the vllm backend only",
        lambda r, _: bool(r.server.url) and r.backend != "vllm",
        "rollout",
    ),
    Refusal(
        "rollout.server.url",
        "empty with rollout.max_staleness=0",
        "the synchronous loop samples with a colocated vLLM engine; servers serve asynchronous RL",
        lambda r, _: bool(r.server.url) and r.max_staleness == 0,
        "rollout",
    ),
    *(
        Refusal(
            f"rollout.vllm.{key}",
            f"{default!r} unless microrl starts vLLM servers (rollout.backend=vllm, "
            "rollout.max_staleness >= 1, no rollout.server.url)",
            "it places the vLLM servers microrl starts; a server you start takes its GPUs and "
            "--tensor-parallel-size itself",
            lambda r, _, key=key, default=default: (
                getattr(r.vllm, key) != default and not _local_servers(r)
            ),
            "rollout",
        )
        for key, default in (("gpus", ""), ("tensor_parallel_size", 1))
    ),
    Refusal(
        "rollout.vllm.tensor_parallel_size",
        "1 without rollout.vllm.gpus",
        "a server beside its trainer process takes that process's one GPU; list dedicated GPUs "
        "in rollout.vllm.gpus",
        lambda r, _: r.vllm.tensor_parallel_size != 1 and not r.vllm.gpus,
        "rollout",
    ),
    Refusal(
        "rollout.vllm.sleep_level",
        "0 for vLLM servers (rollout.backend=vllm with rollout.max_staleness >= 1)",
        "they sample while the trainer trains; sleep mode is the in-process engine's",
        lambda r, _: r.vllm.sleep_level != 0 and r.backend == "vllm" and r.max_staleness >= 1,
        "rollout",
    ),
    Refusal(
        "rollout.vllm.engine_kwargs",
        "empty with rollout.server.url",
        "it configures the engines microrl starts; servers you started take vLLM's flags on "
        "their own command line",
        lambda r, _: bool(r.vllm.engine_kwargs) and bool(r.server.url),
        "rollout",
    ),
    # ---- teacher
    Refusal(
        "teacher.server.url",
        "empty unless teacher.backend=vllm",
        "the engine teacher runs in the trainer process",
        lambda t, _: bool(t.server.url) and t.backend != "vllm",
        "teacher",
        recipes=("grpo",),
    ),
    Refusal(
        "teacher.server.url",
        "empty without teacher.path",
        "teacher.path names the served model's checkpoint or Hub id, whose tokenizer is checked "
        "against the student's",
        lambda t, _: bool(t.server.url) and not t.enabled,
        "teacher",
        recipes=("grpo",),
    ),
    # ---- recipe: keys of several sections
    Refusal(
        "actor.lora.rank",
        ">= 1 unless actor.policy_loss.kl_coef=0 and train.kl_metric_every=0",
        "the KL's reference is the base model with the adapter disabled, which a full "
        "fine-tune (rank 0) has not",
        lambda c, _: c.actor.lora.rank < 1 and _kl_used(c),
    ),
    Refusal(
        "actor.policy_loss.bypass_mode",
        "false with rollout.backend=vllm",
        "vLLM's log-probs are not the trainer's: the bypass needs rollout.backend=hf, which "
        "samples the trained model itself",
        lambda c, _: c.actor.policy_loss.bypass_mode and c.rollout.backend != "hf",
    ),
    Refusal(
        "actor.policy_loss.bypass_mode",
        "false with rollout.max_staleness > 0",
        "the old log-probs must be the trainer's recomputed ones, the proximal policy; the "
        "sampler's are a stale behaviour policy",
        lambda c, _: c.actor.policy_loss.bypass_mode and c.rollout.max_staleness > 0,
    ),
    Refusal(
        "train.mini_batch_size",
        "a divisor of rollout.prompts_per_step * rollout.group_size",
        "every optimizer step takes a full mini-batch of the rollout",
        lambda c, _: (
            (c.rollout.prompts_per_step * c.rollout.group_size) % c.train.mini_batch_size != 0
        ),
        detail=lambda c, _: f" = {c.rollout.prompts_per_step * c.rollout.group_size}",
    ),
    Refusal(
        "task.rewards.overlong_buffer",
        "below rollout.max_new_tokens",
        "DAPO's penalty ramps over the last N tokens before it, starting after the first; 0: off",
        lambda c, _: c.task.rewards.overlong_buffer >= c.rollout.max_new_tokens,
        detail=lambda c, _: f" = {c.rollout.max_new_tokens}",
    ),
    Refusal(
        "task.rewards.overlong_buffer",
        f"0 with task.name={_EPISODE_TASKS} or a task.agent.function",
        "an episode's response is several turns with observations between them; "
        "rollout.max_episode_tokens bounds it",
        lambda c, _: c.task.rewards.overlong_buffer != 0 and c.task.multi_turn,
    ),
    Refusal(
        "rollout.group_size",
        ">= 2 for GRPO",
        "its baseline is the mean reward of a prompt's group",
        lambda c, _: c.rollout.group_size < 2,
        recipes=("grpo",),
    ),
    Refusal(
        "task.agent.function",
        "null with actor.sequence_parallel_size > 1",
        "an sp group's ranks train the same rows; agents on each would play different episodes",
        lambda c, _: c.task.agent.enabled and c.actor.sequence_parallel_size != 1,
        recipes=("grpo",),
    ),
    Refusal(
        "teacher.path",
        f"empty with task.name={_EPISODE_TASKS} or a task.agent.function",
        "distillation scores single-turn responses; multi-turn rows hold observations too",
        lambda c, _: c.teacher.enabled and c.task.multi_turn,
        recipes=("grpo",),
    ),
    Refusal(
        "rollout.dynamic_sampling",
        "false for PPO",
        "it keeps groups whose rewards differ, which only group-relative advantages need: use "
        "the GRPO recipe",
        lambda c, _: c.rollout.dynamic_sampling,
        recipes=("ppo",),
    ),
    Refusal(
        "critic.sequence_parallel_size",
        "equal to actor.sequence_parallel_size for PPO",
        "an sp group's processes are one data rank, which both engines must share",
        lambda c, _: c.critic.sequence_parallel_size != c.actor.sequence_parallel_size,
        recipes=("ppo",),
        detail=lambda c, _: f" = {c.actor.sequence_parallel_size}",
    ),
    *(
        Refusal(
            key,
            must,
            "multi-turn tasks and agents train with the GRPO recipe, whose group baseline needs "
            "no value of the observation tokens",
            refused,
            recipes=("ppo",),
        )
        for key, must, refused in (
            (
                "task.name",
                "a single-turn task for PPO",
                lambda c, _: c.task.name in EPISODE_TASK_NAMES,
            ),
            ("task.agent.function", "null for PPO", lambda c, _: c.task.agent.enabled),
        )
    ),
    # ---- images: checked at start, when the task's prompts carry images
    Refusal(
        "rollout.backend",
        "hf for prompts with images on this machine",
        "vLLM's Qwen-VL code does not load here; docs/rollouts.md#with-the-vllm-backend",
        lambda c, f: c.rollout.backend == "vllm" and bool(f.get("vllm_vision")),
        "images",
        detail=lambda c, f: f": {f['vllm_vision']}",
    ),
    Refusal(
        "teacher.path",
        "empty for a task with images",
        "a distillation teacher does not score image prompts yet",
        lambda c, _: getattr(c, "teacher", None) is not None and c.teacher.enabled,
        "images",
        recipes=("grpo",),
    ),
    Refusal(
        "task.agent.function",
        "null for a task with images",
        "an agent's episodes do not take prompts with images yet",
        lambda c, _: c.task.agent.enabled,
        "images",
    ),
)


def check_refusals(
    scope: str, obj: Any, *, recipe: str | None = None, facts: Facts | None = None
) -> None:
    """Raise the first broken row's ``ValueError`` among ``scope``'s (``recipe``: only the rows
    binding that recipe), checked on ``obj`` (the scope's section, or the recipe's config)."""
    if scope not in _SCOPES:
        raise ValueError(f"scope must be one of {', '.join(_SCOPES)}, got {scope!r}")
    facts = facts or {}
    for row in REFUSALS:
        binds = row.scope == scope and (recipe is None or recipe in row.recipes)
        if binds and row.refused(obj, facts):
            raise row.error(obj, facts)


def check_vllm_servers(vllm: Any, urls: list[str] | tuple[str, ...]) -> None:
    """The ``rollout`` rows for vLLM servers built outside a recipe config: ``vllm`` (a
    :class:`~microrl.configs.rollout.VLLMConfig`) sampling ahead on the user's ``urls`` (none:
    servers microrl starts)."""
    from microrl.configs.endpoint import EndpointConfig
    from microrl.configs.run import RolloutConfig  # which imports this module

    server = EndpointConfig(url=",".join(urls))
    RolloutConfig(backend="vllm", max_staleness=1, server=server, vllm=vllm)  # checks its rows


_CHECKED = {
    "task": "load",
    "rollout": "load",
    "teacher": "load",
    "recipe": "load",
    "images": "start, with images",
}


def refusals_markdown() -> str:
    """The table of :data:`REFUSALS` as docs/recipes.md#what-composes shows it."""
    lines = ["| key | must be | because | recipes | checked |", "|---|---|---|---|---|"]
    for row in REFUSALS:
        cells = (
            f"`{row.key}`",
            row.must,
            row.why,
            ", ".join(r.upper() for r in row.recipes),
            _CHECKED[row.scope],
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="print the table of what composes (markdown)")
    parser.parse_args(argv)
    print(refusals_markdown(), end="")


if __name__ == "__main__":
    _main()

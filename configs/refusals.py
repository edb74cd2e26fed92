"""What composes: every rule that ties keys of two config sections, in one table.

A section checks its own keys in its ``__post_init__``; a rule that ties two sections
(``task.name`` and ``task.dataset``, the vLLM servers and the synchronous loop, a teacher and
multi-turn tasks, a recipe and what it cannot train, ...) is a :class:`Refusal` row of
:data:`REFUSALS`, checked by :func:`check_refusals`. docs/recipes.md#what-composes is rendered
from this table (:func:`refusals_markdown`, ``python -m microrl.configs.refusals``; a test keeps
it current). A row's ``scope`` says when it is checked and what its predicate gets:

- ``task``, ``rollout``, ``teacher``: that section, when it is built (also outside a recipe);
- ``recipe``: the recipe's whole config, when it is built (``recipes``: which);
- ``images``: the recipe's config when the run starts and its task's prompts carry images
  (``facts["vllm_vision"]``: why vLLM cannot sample them on this machine, or None).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
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
    breaks the rule; ``detail(obj, facts)``: what the error adds to ``must`` (a computed bound);
    ``example``: overrides that break this rule and no other (tests/configs/test_refusals.py).
    """

    key: str
    must: str
    why: str
    refused: Callable[[Any, Facts], bool]
    scope: str = "recipe"
    recipes: tuple[str, ...] = RECIPES
    detail: Callable[[Any, Facts], str] | None = None
    example: tuple[str, ...] = ()

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


def _rollout_size(c: Any) -> int:
    return c.rollout.prompts_per_step * c.rollout.group_size


# A section's rows, and the images scope's; a plain Refusal binds the recipe's config.
_task, _rollout, _teacher, _images = (
    partial(Refusal, scope=scope) for scope in ("task", "rollout", "teacher", "images")
)
_FILE_TASKS = " or ".join(FILE_TASK_NAMES)
_EPISODE_TASKS = " or ".join(EPISODE_TASK_NAMES)
_AGENT_TASKS = " or ".join(AGENT_TASK_NAMES)
_LOCAL_SERVERS = (
    "microrl starts vLLM servers (rollout.backend=vllm, rollout.max_staleness >= 1, no "
    "rollout.server.url)"
)
_SERVERS = ("rollout.backend=vllm", "rollout.max_staleness=1")  # what starts vLLM servers
_PPO_MULTI_TURN = (
    "multi-turn tasks and agents train with the GRPO recipe, whose group baseline needs no value "
    "of the observation tokens"
)

REFUSALS: tuple[Refusal, ...] = (
    # ---- task: task.name and the sections it nests
    _task(
        "task.dataset.train_file",
        f"a .jsonl or .parquet file or a Hub dataset name for task.name={_FILE_TASKS}",
        "their prompts are its rows",
        lambda t, _: t.name in FILE_TASK_NAMES and not t.dataset.train_file,
        example=("task.name=dataset", "task.rewards.functions=[m:f]"),
    ),
    _task(
        "task.dataset.train_file",
        f"null unless task.name={_FILE_TASKS}",
        "the built-in tasks make their own prompts: set task.name=dataset to train on a file",
        lambda t, _: t.name not in FILE_TASK_NAMES and t.dataset.train_file is not None,
        example=("task.dataset.train_file=x.jsonl",),
    ),
    _task(
        "task.dataset.eval_file",
        f"null unless task.name={_FILE_TASKS}",
        "the built-in tasks make their own held-out prompts",
        lambda t, _: t.name not in FILE_TASK_NAMES and t.dataset.eval_file is not None,
        example=("task.dataset.eval_file=x.jsonl",),
    ),
    _task(
        "task.images.field",
        "null unless task.name=dataset",
        "only a dataset's rows hold images; task.name=digits draws its own",
        lambda t, _: t.images.field is not None and t.name != "dataset",
        example=("task.images.field=image",),
    ),
    _task(
        "task.env",
        "an environment factory (module:function) for task.name=env, and null otherwise",
        "the env task plays the dataset's prompts against the environments it builds",
        lambda t, _: (t.name == "env") != bool(t.env),
        example=("task.env=my_envs:make_env",),
    ),
    _task(
        "task.rewards.functions",
        "a non-empty list of reward functions for task.name=dataset, e.g. [my_reward:score] or "
        "[microrl.tasks.rewards:exact_match], unless task.reward_model.path, task.judge.url or "
        "a task.agent.function that returns the reward is set",
        "a dataset has no reward of its own",
        lambda t, _: t.name == "dataset" and not t.reward_terms() and not t.agent.enabled,
        example=("task.name=dataset", "task.dataset.train_file=x.jsonl"),
    ),
    _task(
        "task.rewards.weights",
        "empty or one weight per reward term",
        "they weigh task.rewards.functions, task.reward_model and task.judge, in that order",
        lambda t, _: bool(t.rewards.weights) and len(t.rewards.weights) != len(t.reward_terms()),
        detail=lambda t, _: f" ({len(t.reward_terms())}: {', '.join(t.reward_terms()) or 'none'})",
        example=("task.rewards.weights=[1.0]",),
    ),
    _task(
        "task.agent.function",
        f"null for task.name={_EPISODE_TASKS}",
        "their environments play the episodes",
        lambda t, _: t.agent.enabled and t.name in EPISODE_TASK_NAMES,
        example=("task.name=hinted_addition", "task.agent.function=m:f"),
    ),
    _task(
        "task.agent.function",
        f"an agent (module:function or file.py:function) for task.name={_AGENT_TASKS}, e.g. "
        "examples/calculator_agent.py:agent",
        "an agent plays that task, nothing else does",
        lambda t, _: t.name in AGENT_TASK_NAMES and not t.agent.enabled,
        example=("task.name=calculator", "task.max_operand=999"),
    ),
    _task(
        "task.reward_model.path",
        f"empty with task.name={_EPISODE_TASKS}",
        "their environments give the rewards",
        lambda t, _: t.reward_model.enabled and t.name in EPISODE_TASK_NAMES,
        example=("task.name=hinted_addition", "task.reward_model.path=my/rm"),
    ),
    _task(
        "task.judge.url",
        f"empty with task.name={_EPISODE_TASKS}",
        "their environments give the rewards",
        lambda t, _: t.judge.enabled and t.name in EPISODE_TASK_NAMES,
        example=(
            "task.name=hinted_addition",
            "task.judge.url=http://j:8000/v1",
            "task.judge.model=m",
        ),
    ),
    # ---- rollout: the backends, the servers and the synchronous loop
    _rollout(
        "rollout.server.url",
        "empty unless rollout.backend=vllm",
        "vLLM servers sample for the vllm backend only",
        lambda r, _: bool(r.server.url) and r.backend != "vllm",
        example=("rollout.max_staleness=1", "rollout.server.url=http://h:8000"),
    ),
    _rollout(
        "rollout.server.url",
        "empty with rollout.max_staleness=0",
        "the synchronous loop samples with a colocated vLLM engine; servers serve asynchronous RL",
        lambda r, _: bool(r.server.url) and r.max_staleness == 0,
        example=("rollout.backend=vllm", "rollout.server.url=http://h:8000"),
    ),
    _rollout(
        "rollout.vllm.gpus",
        f"'' unless {_LOCAL_SERVERS}",
        "it places the vLLM servers microrl starts; a server you start takes its GPUs itself",
        lambda r, _: bool(r.vllm.gpus) and not _local_servers(r),
        example=("rollout.vllm.gpus=2",),
    ),
    _rollout(
        "rollout.vllm.tensor_parallel_size",
        f"1 unless {_LOCAL_SERVERS}",
        "it places the vLLM servers microrl starts; a server you start takes its "
        "--tensor-parallel-size itself",
        lambda r, _: r.vllm.tensor_parallel_size != 1 and not _local_servers(r),
        example=("rollout.vllm.tensor_parallel_size=2",),
    ),
    _rollout(
        "rollout.vllm.tensor_parallel_size",
        "1 without rollout.vllm.gpus",
        "a server beside its trainer process takes that process's one GPU; list dedicated GPUs "
        "in rollout.vllm.gpus",
        lambda r, _: r.vllm.tensor_parallel_size != 1 and not r.vllm.gpus,
        example=(*_SERVERS, "rollout.vllm.tensor_parallel_size=2"),
    ),
    _rollout(
        "rollout.vllm.sleep_level",
        "0 for vLLM servers (rollout.backend=vllm with rollout.max_staleness >= 1)",
        "they sample while the trainer trains; sleep mode is the in-process engine's",
        lambda r, _: r.vllm.sleep_level != 0 and r.backend == "vllm" and r.max_staleness >= 1,
        example=(*_SERVERS, "rollout.vllm.sleep_level=1"),
    ),
    _rollout(
        "rollout.vllm.engine_kwargs",
        "empty with rollout.server.url",
        "it configures the engines microrl starts; servers you started take vLLM's flags on "
        "their own command line",
        lambda r, _: bool(r.vllm.engine_kwargs) and bool(r.server.url),
        example=(
            *_SERVERS,
            "rollout.server.url=http://h:8000",
            "rollout.vllm.engine_kwargs.max_num_seqs=8",
        ),
    ),
    # ---- teacher
    _teacher(
        "teacher.server.url",
        "empty unless teacher.backend=vllm",
        "the engine teacher runs in the trainer process",
        lambda t, _: bool(t.server.url) and t.backend != "vllm",
        recipes=("grpo",),
        example=("teacher.path=my/teacher", "teacher.server.url=http://h:8000"),
    ),
    _teacher(
        "teacher.server.url",
        "empty without teacher.path",
        "teacher.path names the served model's checkpoint or Hub id, whose tokenizer is checked "
        "against the student's",
        lambda t, _: bool(t.server.url) and not t.enabled,
        recipes=("grpo",),
        example=("teacher.backend=vllm", "teacher.server.url=http://h:8000"),
    ),
    # ---- recipe: keys of several sections
    Refusal(
        "actor.lora.rank",
        ">= 1 unless actor.policy_loss.kl_coef=0 and train.kl_metric_every=0",
        "the KL's reference is the base model with the adapter disabled, which a full "
        "fine-tune (rank 0) has not",
        lambda c, _: c.actor.lora.rank < 1 and _kl_used(c),
        example=("actor.lora.rank=0",),
    ),
    Refusal(
        "actor.policy_loss.bypass_mode",
        "false with rollout.backend=vllm",
        "vLLM's log-probs are not the trainer's: the bypass needs rollout.backend=hf, which "
        "samples the trained model itself",
        lambda c, _: c.actor.policy_loss.bypass_mode and c.rollout.backend != "hf",
        example=("rollout.backend=vllm", "actor.policy_loss.bypass_mode=true"),
    ),
    Refusal(
        "actor.policy_loss.bypass_mode",
        "false with rollout.max_staleness > 0",
        "the old log-probs must be the trainer's recomputed ones, the proximal policy; the "
        "sampler's are a stale behaviour policy",
        lambda c, _: c.actor.policy_loss.bypass_mode and c.rollout.max_staleness > 0,
        example=("rollout.max_staleness=1", "actor.policy_loss.bypass_mode=true"),
    ),
    Refusal(
        "train.mini_batch_size",
        "a divisor of rollout.prompts_per_step * rollout.group_size",
        "every optimizer step takes a full mini-batch of the rollout",
        lambda c, _: _rollout_size(c) % c.train.mini_batch_size != 0,
        detail=lambda c, _: f" = {_rollout_size(c)}",
        example=("train.mini_batch_size=100",),
    ),
    Refusal(
        "task.rewards.overlong_buffer",
        "below rollout.max_new_tokens",
        "DAPO's penalty ramps over the last N tokens before it, starting after the first; 0: off",
        lambda c, _: c.task.rewards.overlong_buffer >= c.rollout.max_new_tokens,
        detail=lambda c, _: f" = {c.rollout.max_new_tokens}",
        example=("task.rewards.overlong_buffer=4", "rollout.max_new_tokens=4"),
    ),
    Refusal(
        "task.rewards.overlong_buffer",
        f"0 with task.name={_EPISODE_TASKS} or a task.agent.function",
        "an episode's response is several turns with observations between them; "
        "rollout.max_episode_tokens bounds it",
        lambda c, _: c.task.rewards.overlong_buffer != 0 and c.task.multi_turn,
        example=("task.name=hinted_addition", "task.rewards.overlong_buffer=2"),
    ),
    Refusal(
        "rollout.group_size",
        ">= 2 for GRPO",
        "its baseline is the mean reward of a prompt's group",
        lambda c, _: c.rollout.group_size < 2,
        recipes=("grpo",),
        example=("rollout.group_size=1", "train.mini_batch_size=128"),
    ),
    Refusal(
        "task.agent.function",
        "null with actor.sequence_parallel_size > 1",
        "an sp group's ranks train the same rows; agents on each would play different episodes",
        lambda c, _: c.task.agent.enabled and c.actor.sequence_parallel_size != 1,
        recipes=("grpo",),
        example=("task.agent.function=m:f", "actor.sequence_parallel_size=2"),
    ),
    Refusal(
        "teacher.path",
        f"empty with task.name={_EPISODE_TASKS} or a task.agent.function",
        "distillation scores single-turn responses; multi-turn rows hold observations too",
        lambda c, _: c.teacher.enabled and c.task.multi_turn,
        recipes=("grpo",),
        example=("teacher.path=my/teacher", "task.name=hinted_addition"),
    ),
    Refusal(
        "rollout.dynamic_sampling",
        "false for PPO",
        "it keeps groups whose rewards differ, which only group-relative advantages need: use "
        "the GRPO recipe",
        lambda c, _: c.rollout.dynamic_sampling,
        recipes=("ppo",),
        example=("rollout.dynamic_sampling=true",),
    ),
    Refusal(
        "critic.sequence_parallel_size",
        "equal to actor.sequence_parallel_size for PPO",
        "an sp group's processes are one data rank, which both engines must share",
        lambda c, _: c.critic.sequence_parallel_size != c.actor.sequence_parallel_size,
        recipes=("ppo",),
        detail=lambda c, _: f" = {c.actor.sequence_parallel_size}",
        example=("critic.sequence_parallel_size=2",),
    ),
    Refusal(
        "task.name",
        "a single-turn task for PPO",
        _PPO_MULTI_TURN,
        lambda c, _: c.task.name in EPISODE_TASK_NAMES,
        recipes=("ppo",),
        example=("task.name=hinted_addition",),
    ),
    Refusal(
        "task.agent.function",
        "null for PPO",
        _PPO_MULTI_TURN,
        lambda c, _: c.task.agent.enabled,
        recipes=("ppo",),
        example=("task.agent.function=m:f",),
    ),
    Refusal(
        "rollout.routing_replay",
        "false with a dense toy base (model.toy_arch=dense)",
        "it has no experts to route; model.toy_arch=moe builds a mixture of experts",
        lambda c, _: (
            c.rollout.routing_replay
            and c.model.toy_arch == "dense"
            and c.model.toy_path() is not None
        ),
        example=("rollout.routing_replay=true",),
    ),
    Refusal(
        "rollout.routing_replay",
        "false with rollout.backend=vllm for now",
        "vLLM's routing capture (enable_return_routed_experts) is not wired yet, neither for "
        "the colocated engine nor for vLLM servers",
        lambda c, _: c.rollout.routing_replay and c.rollout.backend == "vllm",
        example=("model.path=/models/moe", "rollout.backend=vllm", "rollout.routing_replay=true"),
    ),
    Refusal(
        "rollout.backend",
        "hf with a mixture-of-experts toy base (model.toy_arch=moe) for now",
        "vLLM's CPU build runs a LoRA model's experts with Triton kernels it lacks, and a full "
        "fine-tune's fused expert tensors are not mapped by vLLM's loader yet",
        lambda c, _: (
            c.rollout.backend == "vllm"
            and c.model.toy_arch == "moe"
            and c.model.toy_path() is not None
        ),
        example=("model.toy_arch=moe", "rollout.backend=vllm"),
    ),
    # ---- images: checked at start, when the task's prompts carry images
    _images(
        "rollout.backend",
        "hf for prompts with images on this machine",
        "vLLM's Qwen-VL code does not load here; docs/rollouts.md#with-the-vllm-backend",
        lambda c, f: c.rollout.backend == "vllm" and bool(f.get("vllm_vision")),
        detail=lambda c, f: f": {f['vllm_vision']}",
        example=("rollout.backend=vllm",),
    ),
    _images(
        "teacher.path",
        "empty for a task with images",
        "a distillation teacher does not score image prompts yet",
        lambda c, _: getattr(c, "teacher", None) is not None and c.teacher.enabled,
        recipes=("grpo",),
        example=("teacher.path=my/teacher",),
    ),
    _images(
        "task.agent.function",
        "null for a task with images",
        "an agent's episodes do not take prompts with images yet",
        lambda c, _: c.task.agent.enabled,
        recipes=("grpo",),  # PPO refuses agents at load
        example=("task.agent.function=m:f",),
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

"""The sections every training run has beside its engines: model, task, rollout, loop, output.

The example trainings (:mod:`microrl.configs.examples`) nest them, with their engines' configs,
into one top-level config, and the run library reads them: :mod:`microrl.run.base_model` the
``model`` section, :func:`microrl.tasks.make_task` the ``task`` section. Every field carries its
one-line ``--help`` text; each section validates its own ranges in ``__post_init__`` with a
message that names the key.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import ClassVar

from microrl.configs.endpoint import EndpointConfig
from microrl.configs.fields import config_field, require, require_bool
from microrl.configs.refusals import check_refusals
from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig
from microrl.configs.task import AGENT_TASK_NAMES, EPISODE_TASK_NAMES, TASK_NAMES, TaskConfig

__all__ = [
    "AGENT_TASK_NAMES",
    "EPISODE_TASK_NAMES",
    "TASK_NAMES",
    "TOY_ARCHS",
    "TOY_MODEL_PATHS",
    "TRACKERS_INSTALL",
    "TRACKER_NAMES",
    "LoopConfig",
    "ModelConfig",
    "OutputConfig",
    "RolloutConfig",
    "TaskConfig",
    "WarmStartConfig",
]


@dataclass
class WarmStartConfig:
    """Supervised warm start of a freshly built base model (only when ``model.path`` is empty).

    It trains until the greedy accuracy on 500 training prompts (the held-out ones are kept for
    RL), checked every ``eval_every`` steps, reaches ``target_accuracy`` (or ``max_steps`` pass): a
    partly trained base leaves RL visible room to improve. Checked often, the stop lands just above
    the target wherever rounding puts the toy model's sudden jump in accuracy, which a fixed step
    count would not (microrl/run/base_model.py).
    """

    max_steps: int = config_field(3000, "most supervised warm-start steps (a safety cap)")
    batch_size: int = config_field(64, "warm-start prompts per step, across all processes")
    lr: float = config_field(3e-3, "warm-start learning rate (AdamW, full fine-tune)")
    target_accuracy: float = config_field(0.3, "stop warm-starting at this greedy accuracy")
    eval_every: int = config_field(10, "check the warm-start accuracy every N steps")
    tool_share: float = config_field(
        0.1,
        "task.name=calculator: the share of warm-start problems solved by calling the tool "
        "(the rest are answered at once; docs/tasks.md#calculator)",
    )

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_size", "eval_every"):
            require(getattr(self, key) >= 1, f"model.warm_start.{key}", ">= 1", getattr(self, key))
        require(self.lr > 0, "model.warm_start.lr", "> 0", self.lr)
        require(
            0 <= self.tool_share <= 1, "model.warm_start.tool_share", "in [0, 1]", self.tool_share
        )
        require(
            0 < self.target_accuracy <= 1,
            "model.warm_start.target_accuracy",
            "in (0, 1]",
            self.target_accuracy,
        )


#: The toy base's architectures (model.toy_arch): a dense Llama-architecture decoder, or a
#: Qwen3-MoE mixture of experts (microrl/run/toy_model.py builds each).
TOY_ARCHS = ("dense", "moe")


@dataclass
class ModelConfig:
    """Where the base model lives and, when it must be built, its size.

    ``path`` holding a transformers checkpoint (``config.json`` + tokenizer) is loaded as is, and
    the size fields are ignored. A toy model (``toy_arch``: a tiny Llama-architecture decoder, or
    a tiny Qwen3-MoE; :mod:`microrl.run.toy_model`) is built, warm-started and saved there only at
    one of the examples' own :data:`TOY_MODEL_PATHS` (one toy per architecture: ``toy_arch=moe``
    uses ``<path>-moe``) or with ``build_toy``; any other ``path`` that is not a local directory
    is a Hugging Face Hub id, downloaded (:mod:`microrl.run.base_model`).
    """

    path: str = config_field(
        "outputs/base/tiny-adder",
        "base model: a local checkpoint, a Hugging Face Hub id (downloaded), or where the toy "
        "model is built and saved",
    )
    build_toy: bool = config_field(
        False,
        "build and warm-start the toy model at model.path if it holds no checkpoint (always "
        "on at outputs/base/tiny-adder, tiny-words and tiny-digits under outputs/base)",
    )
    toy_arch: str = config_field(
        "dense",
        "architecture of a newly built toy base: dense (Llama) or moe (Qwen3-MoE, 4 experts, "
        "top-2; at the examples' paths it lives at <model.path>-moe)",
    )
    hidden_size: int = config_field(64, "width of a newly built base model")
    intermediate_size: int = config_field(256, "MLP width of a newly built base model")
    num_layers: int = config_field(2, "decoder layers of a newly built base model")
    num_heads: int = config_field(4, "attention heads of a newly built base model")
    head_dim: int = config_field(
        32, "width of each head (vLLM's CPU attention needs >= 32); 0: hidden_size / num_heads"
    )
    max_positions: int = config_field(32, "longest sequence a newly built base model handles")
    seed: int = config_field(0, "seed of a newly built base model's weights and of its warm start")
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        require(bool(self.path), "model.path", "a non-empty path", self.path)
        require(
            self.toy_arch in TOY_ARCHS,
            "model.toy_arch",
            f"one of {', '.join(TOY_ARCHS)}",
            self.toy_arch,
        )
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "max_positions"):
            require(getattr(self, key) >= 1, f"model.{key}", ">= 1", getattr(self, key))
        require(self.head_dim >= 0, "model.head_dim", ">= 0", self.head_dim)
        require(
            self.head_dim > 0 or self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"a multiple of model.num_heads={self.num_heads} (or set model.head_dim)",
            self.hidden_size,
        )

    def toy_path(self) -> str | None:
        """Where this config's toy base is built and reused, None when ``path`` names no toy:
        the examples' :data:`TOY_MODEL_PATHS` hold one toy per architecture (``toy_arch=moe``:
        ``<path>-moe``, so the dense toy saved there is never taken for it); a path with
        ``build_toy`` holds the toy asked for."""
        normal = os.path.normpath(self.path)
        if normal in TOY_MODEL_PATHS:
            return self.path if self.toy_arch == "dense" else f"{normal}-{self.toy_arch}"
        return self.path if self.build_toy else None


# Where the examples build their toy base models without being asked (model.build_toy): the
# default model.path (addition), the word problems' and the toy vision task's (docs/tasks.md).
TOY_MODEL_PATHS = ("outputs/base/tiny-adder", "outputs/base/tiny-words", "outputs/base/tiny-digits")


def _vllm_servers() -> EndpointConfig:
    return EndpointConfig(api_key_env="VLLM_API_KEY")


@dataclass
class RolloutConfig:
    """Sampling. The temperature is ``actor.temperature``: the loss must score the same policy
    that sampled, so there is deliberately no second temperature here."""

    #: Keys before the endpoint type (``server``), read by the loader for one release.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"server_url": "server.url"}
    SECRET_KEYS: ClassVar[dict[str, str]] = {"server_api_key": "server"}

    prompts_per_step: int = config_field(32, "prompts sampled per step, across all processes")
    group_size: int = config_field(8, "responses sampled per prompt (a GRPO group)")
    max_new_tokens: int = config_field(4, "longest response, in tokens (<eos> included)")
    backend: str = config_field("hf", "hf (transformers generate) or vllm (docs/rollouts.md)")
    sync_every: int = config_field(1, "vllm: load the trained weights into vLLM every N steps")
    max_turns: int = config_field(
        4, "multi-turn tasks: most model turns per episode (more: cut, marked truncated)"
    )
    max_episode_tokens: int = config_field(
        1024,
        "multi-turn tasks: most tokens of an episode after its prompt, turns and observations",
    )
    skip_env_errors: bool = config_field(
        False,
        "multi-turn tasks: drop the rows whose environment raised (counted) instead of stopping",
    )
    dynamic_sampling: bool = config_field(
        False,
        "GRPO: sample fresh prompts until prompts_per_step groups have rewards that differ "
        "(DAPO; docs/recipes.md#dapos-knobs; with max_staleness > 0, rounds sampled ahead)",
    )
    max_sampling_rounds: int = config_field(
        4,
        "dynamic_sampling: most sampling rounds per step; then short ranks top up with the last "
        "round's equal-reward groups",
    )
    # Asynchronous RL (docs/async.md): a worker process samples the next
    # steps while the trainer trains, at most max_staleness policy versions behind.
    max_staleness: int = config_field(
        0,
        "asynchronous RL: sample up to N steps ahead in worker processes (hf) or vLLM servers "
        "(vllm), with weights at most N versions old (0: the synchronous loop)",
    )
    sync_check_tol: float | None = config_field(
        None,
        "largest mean |trainer - sampler| probe log-prob difference "
        "(sync/probe_abs_diff_mean) a weight sync to a sampler holding its own weights (vllm, "
        "or max_staleness > 0) may show (null: 5e-5 for a float32 engine, "
        "0.25 for 16-bit)",
    )
    worker_timeout_s: float = config_field(
        600.0, "max_staleness > 0: longest wait for the rollout worker before an error"
    )
    num_workers: int = config_field(
        1,
        "max_staleness > 0: generation processes per trainer process, or per sequence-parallel "
        "group (hf: worker processes; vllm: local vllm serve processes), each sampling its "
        "share of a step's prompts",
    )
    # Mixture-of-experts policies (docs/engine.md#mixture-of-experts): the sampler records each
    # token's experts (routed_experts), which the engines replay (actor.routing_replay).
    routing_replay: bool = config_field(
        False,
        "MoE policies: the sampler records every token's experts and the trainer routes through "
        "them (docs/recipes.md#routing-replay; rollout.backend=hf records, vllm is refused)",
    )
    server: EndpointConfig = field(default_factory=_vllm_servers)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def __post_init__(self) -> None:
        require(
            isinstance(self.max_staleness, int) and self.max_staleness >= 0,
            "rollout.max_staleness",
            "an int >= 0",
            self.max_staleness,
        )
        require(
            isinstance(self.num_workers, int) and self.num_workers >= 1,
            "rollout.num_workers",
            "an int >= 1",
            self.num_workers,
        )
        # rollout.server: vllm serve servers the user started (docs/async.md#vllm-servers).
        self.server.check("rollout.server", several=True)
        require(
            self.sync_check_tol is None or self.sync_check_tol > 0,
            "rollout.sync_check_tol",
            "> 0 or null",
            self.sync_check_tol,
        )
        require(self.worker_timeout_s > 0, "rollout.worker_timeout_s", "> 0", self.worker_timeout_s)
        require(
            self.backend in ROLLOUT_BACKENDS,
            "rollout.backend",
            f"one of {', '.join(ROLLOUT_BACKENDS)}",
            self.backend,
        )
        for key in (
            "sync_every", "prompts_per_step", "group_size", "max_new_tokens", "max_turns",
            "max_episode_tokens",
        ):  # fmt: skip
            require(getattr(self, key) >= 1, f"rollout.{key}", ">= 1", getattr(self, key))
        require_bool(self.dynamic_sampling, "rollout.dynamic_sampling")
        require_bool(self.routing_replay, "rollout.routing_replay")
        require(
            self.max_sampling_rounds >= 1,
            "rollout.max_sampling_rounds",
            ">= 1",
            self.max_sampling_rounds,
        )
        check_refusals("rollout", self)


@dataclass
class LoopConfig:
    """The outer loop: ``steps`` rollouts, each followed by ``ppo_epochs`` passes over it in
    mini-batches of ``mini_batch_size`` sequences (one optimizer step each)."""

    steps: int = config_field(300, "RL steps (one rollout and its updates each); the last step run")
    ppo_epochs: int = config_field(2, "passes over each rollout")
    mini_batch_size: int = config_field(128, "sequences per optimizer step, across all processes")
    eval_every: int = config_field(
        25, "held-out greedy accuracy every N steps (and at the last step)"
    )
    # The reference pass (adapter off) costs a forward over the rollout; with kl_coef = 0 only
    # this metric needs it.
    kl_metric_every: int = config_field(
        25,
        "report the KL to the reference every N steps and at the last (0: never); "
        "every step when actor.policy_loss.kl_coef > 0",
    )
    seed: int = config_field(0, "seed of the LoRA initialisation, prompt order and sampling")
    # On a CPU the tiny model's matrices are too small to gain from intra-op threads, and extra
    # threads spin badly on a busy or small CPU; on a GPU one thread starves the host's work
    # (tokenizing, the hf worker's sampling loop, a CPU-offloaded optimizer step).
    num_threads: int | None = config_field(
        None,
        "CPU threads per process (0: torch's default; null: 1 when the actor's device is the "
        "CPU, torch's default on CUDA)",
    )

    def __post_init__(self) -> None:
        for key in ("steps", "ppo_epochs", "mini_batch_size", "eval_every"):
            require(getattr(self, key) >= 1, f"train.{key}", ">= 1", getattr(self, key))
        require(
            self.num_threads is None
            or (isinstance(self.num_threads, int) and self.num_threads >= 0),
            "train.num_threads",
            "null or an int >= 0",
            self.num_threads,
        )
        require(self.kl_metric_every >= 0, "train.kl_metric_every", ">= 0", self.kl_metric_every)

    def eval_due(self, step: int) -> bool:
        """Whether step ``step`` ends with the held-out evaluation: every ``eval_every``-th, and
        the last."""
        return step % self.eval_every == 0 or step == self.steps

    def kl_due(self, step: int, kl_coef: float) -> bool:
        """Whether step ``step`` needs the reference log-probs: a KL penalty, or the KL metric."""
        every = self.kl_metric_every
        return kl_coef > 0 or (every > 0 and (step % every == 0 or step == self.steps))


# The experiment trackers a run can log to (microrl.run.tracking; docs/tracking.md), each also the
# name of the module it imports; wandb and mlflow come with the extra below.
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")
TRACKERS_INSTALL = 'pip install "microrl[trackers]"'


@dataclass
class OutputConfig:
    """What a run writes into ``dir`` (metrics, sampled completions, tracker logs, curves, adapter,
    optionally the merged model, checkpoint) and what it prints while it trains."""

    dir: str = config_field(
        "outputs/grpo_lora",
        "where the run writes (holding a checkpoint: --resume or --overwrite)",
    )
    save_every: int = config_field(0, "checkpoint every N steps (0: only at the end and on Ctrl-C)")
    trackers: list[str] = config_field(
        ["tensorboard"],
        "experiment trackers getting every step's metrics: tensorboard, wandb, mlflow "
        "(docs/tracking.md)",
    )
    project: str = config_field("microrl", "wandb: the W&B project; mlflow: the experiment")
    tensorboard: bool = config_field(
        True, "false: no TensorBoard, whatever output.trackers says (the older switch)"
    )
    plot: bool = config_field(True, "draw output.dir/curves.png at the end")
    progress: bool = config_field(True, "a live progress bar when stdout is a terminal")
    log_every: int = config_field(10, "without the bar: a plain line every N steps (0: none)")
    log_samples_every: int = config_field(
        10,
        "log output.log_samples completions (prompt, response, reward) every N steps and at the "
        "last, to output.dir/samples.jsonl and the trackers (0: never)",
    )
    log_samples: int = config_field(
        4, "completions per logged step: the first response of each prompt (rank 0's), in order"
    )
    export_merged: bool = config_field(
        False,
        "at the end also write output.dir/merged: the LoRA merged into the base, a plain "
        "transformers checkpoint with its tokenizer (serve with vLLM or transformers, no peft)",
    )

    def __post_init__(self) -> None:
        require(bool(self.dir), "output.dir", "a non-empty path", self.dir)
        for key in ("save_every", "log_every", "log_samples_every"):
            require(getattr(self, key) >= 0, f"output.{key}", ">= 0", getattr(self, key))
        require(self.log_samples >= 1, "output.log_samples", ">= 1", self.log_samples)
        require(
            all(name in TRACKER_NAMES for name in self.trackers)
            and len(set(self.trackers)) == len(self.trackers),
            "output.trackers",
            f"a list of distinct names among {', '.join(TRACKER_NAMES)}",
            self.trackers,
        )
        # Checked here, at startup: a missing library must not wait for the model to be built.
        missing = [name for name in self.trackers if importlib.util.find_spec(name) is None]
        require(
            not missing,
            "output.trackers",
            f"installed trackers ({', '.join(missing)}: {TRACKERS_INSTALL})",
            self.trackers,
        )
        require(bool(self.project), "output.project", "a non-empty name", self.project)

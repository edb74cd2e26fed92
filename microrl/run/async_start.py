"""Asynchronous sampling in a recipe: the samplers and the prefetcher a run starts, its resume.

:func:`start_prefetcher` builds the samplers of ``rollout.backend`` (hf worker processes, or
``vllm serve`` processes; agents' calls wrapped as their jobs) and a
:class:`~microrl.run.prefetcher.RolloutPrefetcher` over them; :func:`resumed_rollouts` reads the
rollouts sampled ahead back from a checkpoint; :func:`warn_if_uncorrected` warns of stale
training without a behaviour-policy correction (docs/async.md).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

from microrl.agents.agent_sampler import AgentSampler
from microrl.configs.run import RolloutConfig
from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.factory import make_sampler
from microrl.rollout.samplers.sp_group import SPGroupSampler
from microrl.rollout.turns import turn_terminators
from microrl.run.prefetcher import CORRECTIONS, ROLLOUT_BUFFER_KEY, RolloutPrefetcher
from microrl.run.sampling import agent_limits
from microrl.tasks import Task, is_agent_task, is_episode_task

__all__ = [
    "close_on_exit",
    "resumed_rollouts",
    "scores_ahead",
    "start_prefetcher",
    "warn_if_uncorrected",
]

logger = logging.getLogger(__name__)


def warn_if_uncorrected(policy_loss: Any, max_staleness: int) -> bool:
    """Log once (a warning) when ``max_staleness > 0`` trains without any behaviour-policy
    correction, naming the ones there are; True when it warned."""
    if max_staleness < 1 or any(getattr(policy_loss, key, None) is not None for key in CORRECTIONS):
        return False
    logger.warning(
        "rollout.max_staleness=%d trains on rollouts up to %d policy versions old without a "
        "behaviour-policy correction; the policy loss offers actor.policy_loss.decoupled_is_cap "
        "(AReaL's decoupled objective), tis_cap (truncated IS), token_ratio_band (IcePop) and "
        "seq_ratio_band (sequence masking), docs/async.md",
        max_staleness,
        max_staleness,
    )
    return True


def start_prefetcher(
    engine,
    tokenizer,
    task: Task,
    params: SamplingParams,
    rng: random.Random,
    prompts_per_step: int,
    *,
    rollout: RolloutConfig,
    task_name: str,
    last_step: int,
    start_step: int,
    num_threads: int = 1,
    state: dict[str, Any] | None = None,
    log_dir: str | None = None,
    scorer: Callable[[Rollout], None] | None = None,
    scorer_collective: bool = False,
    image_encoder: Any = None,
) -> RolloutPrefetcher:
    """The recipes' asynchronous sampling: the samplers of ``rollout.backend`` holding the
    weights of step ``start_step`` and a :class:`RolloutPrefetcher` over them
    (``rollout.max_staleness``, ``rollout.worker_timeout_s``, ``rollout.sync_check_tol``).

    ``hf``: ``rollout.num_workers`` worker processes (:func:`~microrl.rollout.make_async_sampler`); a multi-turn
    task's environments are built in the workers, and a task whose ``make_env`` cannot reach
    them is a ``ValueError`` naming ``task.name``. ``vllm``: a :class:`VLLMServerRollout` on
    ``rollout.num_workers`` local ``vllm serve`` processes, or on the servers of
    ``rollout.server_url`` (key: ``rollout.server_api_key`` or ``VLLM_API_KEY``); environments
    step in the trainer process; ``log_dir``: where the local servers' logs are kept (None:
    temporary files, kept when a server fails); ``scorer``: as :class:`RolloutPrefetcher`'s,
    run on the trainer's thread when ``scorer_collective`` (a collective under ``torchrun``);
    ``image_encoder``: a vision-language policy's: the problems' images go with their jobs."""
    env_maker: Callable[[Any], Any] | None = task.make_env if is_episode_task(task) else None
    try:
        sampler = make_sampler(
            engine,
            tokenizer,
            rollout,
            version=start_step,
            env_maker=env_maker,
            num_threads=num_threads,
            log_dir=log_dir,
            image_encoder=image_encoder,
        )
    except Exception as err:
        if env_maker is None or rollout.backend != "hf":
            raise
        raise ValueError(
            f"task.name={task_name} with rollout.max_staleness={rollout.max_staleness}: the "
            f"environments must be built in the rollout worker process, which failed: {err}"
        ) from err
    if is_agent_task(task):  # the agents run here; their calls are the sampler's jobs
        # Turns end where the workers' sampling stops: the model's generation_config ids too.
        config = getattr(getattr(engine, "model", None), "generation_config", None)
        stops = turn_terminators(tokenizer, config, require_template=False)
        sampler = AgentSampler(
            sampler, tokenizer, task, agent_limits(task, rollout), stop_ids=stops
        )
    ahead = scores_ahead(task, sampler, scorer, scorer_collective=scorer_collective)
    try:
        return RolloutPrefetcher(
            sampler,
            task,
            params,
            rng,
            prompts_per_step,
            max_staleness=rollout.max_staleness,
            last_step=last_step,
            limits=rollout,
            state=state,
            pad_token_id=tokenizer.pad_token_id,
            score_ahead=ahead,
            scorer=scorer,
        )
    except BaseException:
        sampler.close()
        raise


def scores_ahead(
    task: Task, sampler: Any, scorer: Callable | None, *, scorer_collective: bool = False
) -> bool:
    """Whether a round is scored in a background thread as soon as it is sampled: a reward
    model, a judge or a teacher (``scorer``), unless ``collect``, the scorer or the reward is a
    collective (an sp group's sampler, torchrun's teacher or a reward model sharded over the
    ranks): a collective runs on the trainer's thread, every rank in step."""
    reward = getattr(task, "reward", None)
    collective = (
        isinstance(sampler, SPGroupSampler)
        or scorer_collective
        or bool(getattr(reward, "collective", False))
    )
    model_based = bool(getattr(reward, "model_based", False))
    return (model_based or scorer is not None) and not collective


def resumed_rollouts(extra_state: dict[str, Any], max_staleness: int) -> dict[str, Any] | None:
    """The rollouts sampled ahead that a resumed run's checkpoint holds (``extra_state`` from
    :func:`~microrl.run.load_run`), or None. A checkpoint holding some, resumed with
    ``max_staleness=0``, is a ``ValueError``: their prompts are already drawn from the prompt
    stream, and a synchronous run would skip them."""
    state = extra_state.get(ROLLOUT_BUFFER_KEY)
    if state is not None and state["items"] and max_staleness == 0:
        needed = max(1, *((item["step"] - 1) - item["version"] for item in state["items"]))
        raise ValueError(
            f"rollout.max_staleness=0, but the checkpoint holds {len(state['items'])} rollouts "
            f"sampled ahead by a run with rollout.max_staleness={state['max_staleness']}: "
            f"resume with rollout.max_staleness >= {needed} so that they are trained on"
        )
    return state


@contextlib.contextmanager
def close_on_exit(*closables: Any) -> Iterator[None]:
    """Close each of ``closables`` that is not None when the block exits, also on an error."""
    try:
        yield
    finally:
        for closable in closables:
            if closable is not None:
                closable.close()

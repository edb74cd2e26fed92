"""The training-run library the recipes are built from (README "Bring your own task").

:mod:`~microrl.run.cli` (command line, ``--resume``/``--overwrite``), :mod:`~microrl.run.dist`
(ranks, Ctrl-C), :mod:`~microrl.run.checkpoint` (run checkpoints that survive a kill),
:mod:`~microrl.run.tracking` (progress bar or log lines, JSONL, TensorBoard, plot),
:mod:`~microrl.run.session` (the rollouts, evaluation, tracking and shutdown around the RL step),
:mod:`~microrl.run.source` (every step's rollout for any ``rollout.max_staleness``: sampled now
or ahead, scored, filtered),
:mod:`~microrl.run.loop` (a recipe's set-up before its engines, its sampling, its checkpoints),
:mod:`~microrl.run.step_metrics` (a step's metrics, the rollout's counts summed over the ranks),
:mod:`~microrl.run.dynamic_sampling` (DAPO's dynamic sampling: groups whose rewards differ),
:mod:`~microrl.run.sampling` (sample or play episodes, and score, for any task),
:mod:`~microrl.run.vision` (a vision-language policy's image encoder, checked at start) and
:mod:`~microrl.run.base_model` (the base model RL starts from: a local checkpoint, a Hugging Face
Hub model, or the toy model of :mod:`~microrl.run.toy_model` warm-started once).
"""

from microrl.run.base_model import prepare_base_model
from microrl.run.checkpoint import find_run_checkpoint, load_run, save_run
from microrl.run.cli import parse_cli, prepare_output
from microrl.run.dist import Dist, StepFailed, StopOnInterrupt, per_rank
from microrl.run.dynamic_sampling import GroupFilter
from microrl.run.loop import RunStart, overlong_shaping, sampling_params, save_if_due, start_run
from microrl.run.sampling import (
    agent_metrics,
    episode_metrics,
    group_advantages,
    reward_metrics,
    rollout_metrics,
    sample_and_score,
    score_rollout,
    whole_groups,
)
from microrl.run.session import (
    close_on_exit,
    evaluate_accuracy,
    evaluator,
    finish,
    sample_rows,
    start_rollouts,
    start_tracking,
    warn_if_uncorrected,
)
from microrl.run.source import RolloutSource, StepRollout
from microrl.run.step_metrics import step_metrics
from microrl.run.tracking import Tracker, mean_metrics, plot_metrics, read_metrics

__all__ = [
    "Dist",
    "GroupFilter",
    "RolloutSource",
    "RunStart",
    "StepFailed",
    "StepRollout",
    "StopOnInterrupt",
    "Tracker",
    "agent_metrics",
    "close_on_exit",
    "episode_metrics",
    "evaluate_accuracy",
    "evaluator",
    "find_run_checkpoint",
    "finish",
    "group_advantages",
    "load_run",
    "mean_metrics",
    "overlong_shaping",
    "parse_cli",
    "per_rank",
    "plot_metrics",
    "prepare_base_model",
    "prepare_output",
    "read_metrics",
    "reward_metrics",
    "rollout_metrics",
    "sample_and_score",
    "sample_rows",
    "sampling_params",
    "save_if_due",
    "save_run",
    "score_rollout",
    "start_rollouts",
    "start_run",
    "start_tracking",
    "step_metrics",
    "warn_if_uncorrected",
    "whole_groups",
]

"""``microrl.run.loop`` and ``Dist.data_group``: the pieces both recipes share around their step."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch
from tensordict import TensorDict

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.configs.run import LoopConfig
from microrl.run import Dist, overlong_shaping, sampling_params
from microrl.run import loop as loop_module
from microrl.run import session as session_module
from microrl.tasks import overlong_penalty


def test_the_data_group_counts_an_sp_groups_rows_once() -> None:
    engine = SimpleNamespace(dp_group=object())  # the engine's ("dp", "sp") mesh's dp group
    assert Dist().data_group(engine) is None  # one process: no collective
    sp = Dist(rank=1, world_size=4).for_sequence_parallel(2)
    assert sp.data_group(engine) is engine.dp_group


def test_evaluation_is_due_every_eval_every_steps_and_at_the_last() -> None:
    loop = LoopConfig(steps=5, eval_every=2)
    assert [s for s in range(1, 6) if loop.eval_due(s)] == [2, 4, 5]


def test_sampling_and_the_overlong_shaping_follow_the_config() -> None:
    cfg = load_config(
        GRPOExampleConfig, None, ["rollout.max_new_tokens=4", "task.rewards.overlong_buffer=2"]
    )
    params = sampling_params(cfg)
    assert (params.num_samples, params.temperature, params.max_new_tokens) == (8, 1.0, 4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rollout = SimpleNamespace(batch=TensorDict({"loss_mask": mask}, batch_size=[3]))
    expected = overlong_penalty(torch.tensor([1, 3, 4]), 4, 2, 1.0)
    assert torch.equal(overlong_shaping(cfg)(rollout), expected)
    assert expected.tolist() == [0.0, -0.5, -1.0]


def test_a_checkpoint_is_saved_every_save_every_steps_with_the_extra_state(monkeypatch) -> None:
    saved, asked = [], []
    monkeypatch.setattr(session_module, "save_run", lambda *a, **kw: saved.append(kw))

    def extra_state():  # may wait for the rollouts sampled ahead: only when a save is due
        asked.append(True)
        return {"ahead": 1}

    for every in (3, 0):
        cfg = load_config(GRPOExampleConfig, None, [f"output.save_every={every}"])
        for step in range(1, 8):
            loop_module.save_if_due(
                cfg, {}, step, rng=random.Random(0), dist_info=Dist(), extra_state=extra_state
            )
    assert [kw["step"] for kw in saved] == [3, 6] and len(asked) == 2
    assert all(kw["extra_state"] == {"ahead": 1} for kw in saved)
    loop_module.save_if_due(cfg, {}, 3, rng=random.Random(0), dist_info=Dist())  # save_every=0
    assert len(saved) == 2

"""``train.num_threads`` follows the actor's device (microrl/run/dist.py ``train_threads``).

The default was one torch thread per process everywhere: right for the tiny CPU model (more
threads only spin against the worker's), wrong on a GPU, where the host's own work (tokenizing,
the ``hf`` worker's sampling loop, an ``optim.cpu_offload`` step) then ran on one core. Unset
(``null``) it is now 1 on a CPU and 0 (torch's default) on CUDA; a value the user gives is kept.
"""

from __future__ import annotations

import pytest
import torch
from device_utils import simulated_cuda

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import load_config
from microrl.run.dist import train_threads


@pytest.mark.parametrize("schema", [GRPOExampleConfig, PPOExampleConfig])
def test_unset_threads_are_one_on_a_cpu_and_torchs_default_on_cuda(monkeypatch, schema) -> None:
    cfg = load_config(schema)
    assert cfg.train.num_threads is None  # the recipes' default (configs/*.yaml too)
    assert train_threads(cfg) == 1  # this CPU
    with simulated_cuda(monkeypatch):
        assert train_threads(cfg) == 0
        cpu = load_config(schema, overrides=["actor.device=cpu"])
        assert train_threads(cpu) == 1  # the actor's device decides, not the machine's
        given = load_config(schema, overrides=["train.num_threads=1"])
        assert train_threads(given) == 1  # the user's own value is kept


def test_the_run_start_sets_them_so(monkeypatch) -> None:
    """``start_run`` applies the resolved count: no ``set_num_threads(1)`` on CUDA."""
    from microrl.run import loop

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(loop, "prepare_output", lambda *args: None)
    monkeypatch.setattr(loop, "per_rank", stop)  # right after the threads are set
    cfg = load_config(GRPOExampleConfig)
    with pytest.raises(Stop):
        loop.start_run(cfg, None)
    assert calls == [1]  # the CPU: one thread
    with simulated_cuda(monkeypatch), pytest.raises(Stop):
        loop.start_run(cfg, None)
    assert calls == [1]  # CUDA: torch's default left alone


@pytest.mark.parametrize("bad", [-1, 1.5, "two"])
def test_a_bad_value_names_the_key(bad) -> None:
    with pytest.raises(
        ValueError, match=r"train\.num_threads.* (null or an int >= 0|integer or null)"
    ):
        load_config(GRPOExampleConfig, overrides=[f"train.num_threads={bad}"])

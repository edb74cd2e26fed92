"""The recipes as a GPU run executes them, on simulated CUDA (tests/device_utils.py).

On a CPU the rollout's host tensors and the engines' outputs share one device, so a recipe that
multiplies one by the other passes every CPU test and fails at step 1 on a GPU (the entropy
metric did, and PPO's GAE). Here the engines live on simulated GPUs: any op that mixes a host
tensor with a device one raises as CUDA does, and under torchrun every collective is checked
against the backends its group was created with (NCCL takes device tensors only), while gloo
runs it. Each rank takes its own GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the ranks
from device_utils import check_collectives, simulated_cuda
from distributed_utils import launch
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.run import read_metrics

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve()
QUIET = ["output.plot=false", "output.tensorboard=false", "train.steps=2"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy base model, warm-started on a simulated GPU by the first test that needs it."""
    return tmp_path_factory.mktemp("base") / "tiny-adder"


@pytest.fixture(scope="module")
def vision_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy vision base, built and warm-started on a simulated GPU by the first test."""
    return tmp_path_factory.mktemp("base") / "tiny-digits"


def _args(base: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base}", f"output.dir={out}", *extra]


def test_grpo_on_a_gpu_keeps_every_tensor_on_it(base_model, tmp_path, monkeypatch) -> None:
    """On GPU 1 of 2 (never the current one: nothing may fall back to "cuda"), with DAPO's
    knobs, the reference pass, a checkpoint and a resumed step."""
    args = _args(
        base_model,
        tmp_path / "grpo",
        "actor.device=cuda:1",
        "rollout.dynamic_sampling=true",
        "rollout.max_sampling_rounds=2",
        "task.rewards.overlong_buffer=2",
        "actor.mask_truncated=true",
        "train.kl_metric_every=1",
    )
    with simulated_cuda(monkeypatch, gpus=2):
        assert load_example("grpo_lora").main(args) == 0
        assert load_example("grpo_lora").main([*args, "train.steps=3", "--resume"]) == 0
    records = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all("entropy" in r and "kl" in r for r in records[1:])


def test_multi_turn_grpo_on_a_gpu(base_model, tmp_path, monkeypatch) -> None:
    args = _args(
        base_model, tmp_path / "episodes", "actor.device=cuda", "task.name=hinted_addition"
    )
    with simulated_cuda(monkeypatch):
        assert load_example("grpo_lora").main(args) == 0
    assert "episodes/turns_mean" in read_metrics(tmp_path / "episodes" / "metrics.jsonl")[-1]


def test_asynchronous_grpo_on_a_gpu(base_model, tmp_path, monkeypatch) -> None:
    """rollout.max_staleness=1: the host rollouts sampled ahead, the staleness metrics and each
    push's probe check on the trainer's GPU. The simulation reaches no other process: the hf
    worker samples on the CPU, where the real one takes the trainer's GPU."""
    from microrl.rollout.samplers import hf_worker

    spec = hf_worker.WorkerSpec
    monkeypatch.setattr(hf_worker, "WorkerSpec", lambda **kw: spec(**{**kw, "device": "cpu"}))
    args = _args(base_model, tmp_path / "async", "actor.device=cuda", "rollout.max_staleness=1")
    with simulated_cuda(monkeypatch):
        assert load_example("grpo_lora").main(args) == 0
    records = read_metrics(tmp_path / "async" / "metrics.jsonl")
    assert records[-1]["staleness/max"] == 1
    assert any("sync/probe_abs_diff_mean" in r for r in records), records


def test_moe_grpo_with_routing_replay_on_a_gpu(tmp_path, monkeypatch) -> None:
    """The toy mixture of experts with rollout.routing_replay: the sampler's host key
    (``routed_experts``) meets the routers' device indices in every replayed forward."""
    args = _args(
        tmp_path / "base",
        tmp_path / "moe",
        "actor.device=cuda",
        "model.toy_arch=moe",
        "rollout.routing_replay=true",
        "actor.router_loss.aux_loss_coef=0.01",
    )
    with simulated_cuda(monkeypatch):
        assert load_example("grpo_lora").main(args) == 0
    last = read_metrics(tmp_path / "moe" / "metrics.jsonl")[-1]
    assert last["router/routed_as_sampled"] == 1.0 and "router/aux_loss" in last, last


def test_ppo_on_a_gpu_keeps_every_tensor_on_it(base_model, tmp_path, monkeypatch) -> None:
    """GAE over the critic's device values and the rollout's rewards, the whitening, the
    entropy metric: all on the GPU. With activation offload, both engines' pinned host copies
    are released once the updates are done: nothing stays pinned through sampling."""
    from microrl.engine import offload

    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors qualify
    args = _args(
        base_model,
        tmp_path / "ppo",
        "actor.device=cuda",
        "critic.device=cuda",
        "critic.micro_batch_size=2",
        "actor.activation_offload=true",
        "critic.activation_offload=true",
    )
    with simulated_cuda(monkeypatch) as sim:
        pins = []
        pin = sim.pinned.pin
        monkeypatch.setattr(sim.pinned, "pin", lambda t: (pins.append(t.nbytes), pin(t)))
        assert load_example("ppo_lora").main(args) == 0
        assert pins, "nothing was offloaded to pinned memory"
        assert sim.pinned.held == 0, f"{sim.pinned.held} pinned bytes kept after the run"
    assert "critic/vf_loss" in read_metrics(tmp_path / "ppo" / "metrics.jsonl")[-1]


def test_vision_grpo_on_a_gpu_keeps_every_tensor_on_it(vision_base, tmp_path, monkeypatch) -> None:
    """The toy vision task (task.name=digits) on GPU 1 of 2: the vision base warm-started there,
    the image encoder's host pixels and grids into generate, the rollouts' image keys, the
    engine's mRoPE positions and the image-row mismatch metrics, all on the GPU."""
    args = _args(
        vision_base,
        tmp_path / "vision",
        "actor.device=cuda:1",
        "task.name=digits",
        "train.kl_metric_every=1",
    )
    with simulated_cuda(monkeypatch, gpus=2):
        assert load_example("grpo_lora").main(args) == 0
    records = read_metrics(tmp_path / "vision" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("mismatch/image/kl_k3" in r and "kl" in r for r in records[1:])


def _image_sized_on_gpu(patch_dim: int) -> list[tuple[int, ...]]:
    """Shapes of the live tensors on a (simulated) GPU that hold pixels: float, last dimension
    the patch size, not a parameter (found through the garbage collector's objects)."""
    import gc

    import torch

    return [
        tuple(t.shape)
        for t in gc.get_objects()
        if isinstance(t, torch.Tensor)
        and not isinstance(t, torch.nn.Parameter)
        and t.is_cuda
        and t.is_floating_point()
        and t.dim() >= 2
        and t.shape[-1] == patch_dim
    ]


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_vision_recipes_free_the_steps_pixels_before_the_next_sampling(
    recipe, vision_base, tmp_path, monkeypatch
):
    """A step's images leave the GPU with the step: when the next step samples (the hf
    generation, the largest transient), no pixel tensor of the last one is still referenced."""
    from microrl.run import RolloutSource
    from microrl.run.toy_vision import PATCH_SIZE, TEMPORAL_PATCH

    patch_dim = 3 * TEMPORAL_PATCH * PATCH_SIZE**2
    seen, real = [], RolloutSource.take  # each step's sampling

    def checked(self, step):
        seen.append(_image_sized_on_gpu(patch_dim))
        return real(self, step)

    monkeypatch.setattr(RolloutSource, "take", checked)
    out = tmp_path / recipe
    args = _args(vision_base, out, "actor.device=cuda", "task.name=digits", "train.steps=3")
    if recipe == "ppo":
        args += ["critic.device=cuda", "critic.micro_batch_size=2"]
    with simulated_cuda(monkeypatch, gpus=1):
        assert load_example(f"{recipe}_lora").main(args) == 0
    assert seen == [[], [], []], seen  # steps 1-3: nothing of the step before


@pytest.mark.distributed
def test_grpo_under_torchrun_on_two_gpus(base_model, tmp_path) -> None:
    """Two ranks, each on its own simulated GPU, every collective checked against its group's
    backends: the recipe's host-side sums (metrics, Ctrl-C, evaluation) must reach a backend
    that takes host tensors, the engines' device ones NCCL."""
    launch(2, HERE, str(base_model), str(tmp_path), timeout=400)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["gpu"] for r in ranks] == [0, 1], ranks
    assert all(r["backends"] == ["cpu:gloo,cuda:nccl"] for r in ranks), ranks
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [0, 1, 2]


def _rank_main(base: str, tmp: str) -> None:
    """One rank of test_grpo_under_torchrun_on_two_gpus."""
    monkeypatch = pytest.MonkeyPatch()
    args = _args(Path(base), Path(tmp) / "out", "actor.device=cuda")
    with simulated_cuda(monkeypatch, gpus=2) as sim:
        backends = check_collectives(monkeypatch, sim)
        assert load_example("grpo_lora").main(args) == 0
        gpu = sim.current
    rank = os.environ["RANK"]
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps({"gpu": gpu, "backends": backends}))
    monkeypatch.undo()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])

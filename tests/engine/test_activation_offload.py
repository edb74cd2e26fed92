"""Activation offload (``EngineConfig.activation_offload``, engine/offload.py) on the CPU.

On a CPU device the pack hook copies each saved tensor into a separate host buffer and the
unpack hook hands that copy to the backward: the same mechanics as on a GPU without the
transfers (the CUDA streams are not exercised here). The tests check *what* is offloaded per
micro-batch (counts and bytes; with gradient checkpointing only the decoder layers' inputs and the
tensors saved outside the layers), what is kept (small tensors, parameters, views of them,
autocast's weight copies), that loss, metrics, outputs and every gradient are unchanged, and that
inference never enters the hooks. The 2-rank check under FSDP2 (gathered parameters are not
offloaded) is in tests/engine/parallel/test_cpu_offload.py.

Tolerance: none. The hooks copy the saved bytes and give them back; every operation runs on the
same values in the same order, so results are bitwise equal (``torch.equal``). A difference would
mean a saved tensor came back changed or was taken at the wrong time.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext

import pytest
import torch
from engine_utils import make_batch, tiny_model
from torch import nn

import microrl.engine.offload as offload
from microrl.configs import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.offload import ActivationOffload
from microrl.engine.parallel.distributed import find_shard_units

SGD = OptimConfig(name="sgd", lr=1.0, grad_clip=None)
HEADS = {  # the three head paths of docs/engine.md
    "fused_loss": {"use_fused_kernel": True, "fuse_loss": True},
    "fused_kernel": {"use_fused_kernel": True, "fuse_loss": False},
    "eager": {"use_fused_kernel": False},
}


@pytest.fixture
def offload_everything(monkeypatch):
    """Every saved tensor qualifies by size (the tiny model's are all far below 1 MiB)."""
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)


def _actor(on: bool, *, lora: int = 4, head: str = "fused_loss", **overrides) -> ActorEngine:
    config = ActorConfig(
        micro_batch_size=2,
        lora=LoraConfig(rank=lora, alpha=8.0),
        optim=SGD,
        activation_offload=on,
        **HEADS[head],
        **overrides,
    )
    return ActorEngine(tiny_model(), config)


def _grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def _assert_same_pass(ref: dict, got: dict, ref_grads: dict, got_grads: dict) -> None:
    assert got["loss"] == ref["loss"]
    metrics = dict(got["metrics"])
    assert metrics.pop("offload/bytes") > 0
    assert metrics == ref["metrics"]
    for key, value in ref["model_output"].items():
        assert torch.equal(got["model_output"][key], value), key
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    for name, grad in ref_grads.items():
        assert torch.equal(got_grads[name], grad), f"gradient of {name} differs"


# Each head path with LoRA on and off, and gradient checkpointing on and off across them.
CASES = [
    ("fused_loss", 4, False),
    ("fused_loss", 0, True),
    ("fused_kernel", 4, True),
    ("fused_kernel", 0, False),
    ("eager", 4, False),
    ("eager", 0, True),
]


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize(("head", "lora", "ckpt"), CASES)
def test_loss_metrics_outputs_and_gradients_are_unchanged(head, lora, ckpt):
    batch = make_batch(6, 12, seed=3)
    runs = []
    for on in (False, True):
        engine = _actor(on, lora=lora, head=head, gradient_checkpointing=ckpt)
        runs.append((engine.forward_backward_batch(batch), _grads(engine)))
        assert (engine.last_offload_stats is not None) == on
    (ref, ref_grads), (got, got_grads) = runs
    _assert_same_pass(ref, got, ref_grads, got_grads)


@pytest.mark.usefixtures("offload_everything")
def test_critic_and_packed_rows_are_unchanged():
    batch = make_batch(6, 12, seed=4)
    runs = []
    for on in (False, True):
        config = CriticConfig(micro_batch_size=3, optim=SGD, activation_offload=on)
        critic = CriticEngine(tiny_model(), config)
        actor = _actor(on, pack_sequences=True)
        runs.append([(e.forward_backward_batch(batch), _grads(e)) for e in (critic, actor)])
    for (ref, ref_grads), (got, got_grads) in zip(*runs, strict=True):
        _assert_same_pass(ref, got, ref_grads, got_grads)


def _offloaded_per_layer_depth(engine, micro) -> tuple[list[tuple], int]:
    """One training ``forward_step`` of ``micro``; for each offloaded tensor ``(inside a decoder
    layer's forward?, shape, dtype)`` in saving order, and the number of decoder layers."""
    layers = find_shard_units(engine.module)
    depth = [0]
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
        layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
    seen: list[tuple] = []
    real = ActivationOffload._pack

    def spy(self, tensor):
        before = self.stats.tensors
        packed = real(self, tensor)
        if self.stats.tensors > before:
            seen.append((depth[0] > 0, tuple(tensor.shape), tensor.dtype))
        return packed

    ActivationOffload._pack = spy
    try:
        loss, _, _ = engine.forward_step(micro)
    finally:
        ActivationOffload._pack = real
    loss.backward()
    stats = engine.last_offload_stats
    assert stats.tensors == len(seen)
    return seen, len(layers)


@pytest.mark.usefixtures("offload_everything")
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_with_checkpointing_only_the_layer_boundaries_are_offloaded(lora):
    """Without checkpointing most offloaded tensors are saved inside the decoder layers; with it
    none is: what is offloaded is exactly what is saved outside the layers (final norm, head,
    loss) plus one ``[b, L, H]`` input per decoder layer, which the checkpoint saves before the
    layer runs. Strictly fewer bytes, per micro-batch."""
    micro = make_batch(4, 10, seed=5)
    plain, layers = _offloaded_per_layer_depth(_actor(True, lora=lora), micro)
    ckpt, _ = _offloaded_per_layer_depth(
        _actor(True, lora=lora, gradient_checkpointing=True), micro
    )
    inside = [s for s in plain if s[0]]
    assert len(inside) > 10 * layers, "the plain forward offloads the layers' activations"
    assert not any(s[0] for s in ckpt), "an activation inside a checkpointed layer was offloaded"
    outside = sorted(str(s[1:]) for s in plain if not s[0])
    width = int(micro["attention_mask"].sum(1).max())  # the micro-batch's compact width
    boundary = str(((4, width, 32), torch.float32))  # [b, L, H]: one per layer
    assert sorted(str(s[1:]) for s in ckpt) == sorted([*outside, *[boundary] * layers])

    def total(seen):
        return sum(
            torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in seen
        )

    assert total(ckpt) < total(plain)


@pytest.mark.usefixtures("offload_everything")
def test_stats_add_up_to_the_offload_bytes_metric_and_count_per_micro_batch():
    batch = make_batch(6, 12, seed=6)
    engine = _actor(True)
    per_micro = []
    real = ActivationOffload.__exit__

    def spy(self, *exc):
        real(self, *exc)
        per_micro.append((self.stats.tensors, self.stats.bytes))

    ActivationOffload.__exit__ = spy
    try:
        metrics = engine.train_batch(batch)
    finally:
        ActivationOffload.__exit__ = real
    assert len(per_micro) == 3  # 6 rows, 2 per micro-batch
    assert all(n > 0 for n, _ in per_micro)
    assert metrics["offload/bytes"] == sum(b for _, b in per_micro)
    assert engine.last_offload_stats.bytes == per_micro[-1][1]
    assert "offload/bytes" not in _actor(False).train_batch(batch)


def test_small_tensors_stay_by_default_and_the_threshold_is_a_constant(monkeypatch):
    batch = make_batch(4, 10, seed=7)
    engine = _actor(True)
    engine.forward_backward_batch(batch)
    stats = engine.last_offload_stats
    assert offload.MIN_OFFLOAD_BYTES == 1 << 20
    assert stats.tensors == 0 and stats.bytes == 0 and stats.kept_small > 0
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 1024)  # a [2, >= 4, 32] fp32 activation
    engine.forward_backward_batch(batch)
    stats = engine.last_offload_stats
    assert stats.tensors > 0 and stats.bytes >= stats.tensors * offload.MIN_OFFLOAD_BYTES


@pytest.mark.usefixtures("offload_everything")
def test_parameters_and_their_views_are_never_copied():
    """No offloaded tensor shares storage with a parameter or buffer; the weights ``F.linear``
    saves (``weight.t()``: views of parameters) are counted as kept."""
    engine = _actor(True, lora=0, head="eager")
    storages = {
        t.untyped_storage().data_ptr()
        for t in [*engine.module.parameters(), *engine.module.buffers()]
    }
    copied = []
    real = ActivationOffload._pack

    def spy(self, tensor):
        before = self.stats.tensors
        packed = real(self, tensor)
        if self.stats.tensors > before:
            copied.append(tensor.untyped_storage().data_ptr())
        return packed

    ActivationOffload._pack = spy
    try:
        engine.forward_backward_batch(make_batch(4, 10, seed=8))
    finally:
        ActivationOffload._pack = real
    linears = sum(isinstance(m, nn.Linear) for m in engine.module.modules())
    assert copied and not storages.intersection(copied)
    assert engine.last_offload_stats.kept_params >= linears


@pytest.mark.usefixtures("offload_everything")
def test_inference_never_enters_the_hooks():
    batch = make_batch(6, 12, seed=9)
    entered = []
    real = ActivationOffload.__enter__

    def spy(self):
        entered.append(1)
        return real(self)

    ref = _actor(False).infer_batch(batch)
    engine = _actor(True)
    ActivationOffload.__enter__ = spy
    try:
        got = engine.infer_batch(batch)
        forward_only = engine.forward_backward_batch(batch, forward_only=True)
    finally:
        ActivationOffload.__enter__ = real
    assert not entered and engine.last_offload_stats is None
    assert "offload/bytes" not in forward_only["metrics"]
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
    engine.forward_backward_batch(batch)  # a training pass does
    assert engine.last_offload_stats is not None


def test_what_the_hooks_keep_and_copy():
    """The rule of engine/offload.py on plain tensors: activations are copied (exactly, into a
    new buffer); a parameter, its views, and autocast's bf16 copies of trainable and frozen
    weights are kept; an in-place change of a kept saved tensor is refused as autograd does."""
    torch.manual_seed(0)
    layer, frozen = nn.Linear(16, 8), nn.Linear(8, 4)
    frozen.requires_grad_(False)
    x = torch.randn(3, 16, requires_grad=True)
    params = [*layer.parameters(), *frozen.parameters()]

    def grads(hooks):
        for p in (*params, x):
            p.grad = None
        with hooks:
            y = frozen(torch.tanh(layer(x))).square().sum()
        y.backward()
        return [t.grad.clone() for t in (x, layer.weight, layer.bias)]

    hooks = ActivationOffload(params, min_bytes=0, record=True)
    assert all(torch.equal(a, b) for a, b in zip(grads(nullcontext()), grads(hooks), strict=True))
    # Copied: x (a leaf, but no parameter: the first matmul saves it for the weight's gradient),
    # tanh's output (for tanh's backward; the frozen layer's matmul saves no input: its weight
    # needs no gradient) and square's input. Kept: the two weights the matmuls save (views).
    assert hooks.stats.tensors == 3 and hooks.stats.kept_params == 2
    assert {r[0] for r in hooks.stats.records} == {(3, 16), (3, 8), (3, 4)}

    auto = ActivationOffload(params, min_bytes=0, record=True)
    with auto, torch.autocast("cpu", dtype=torch.bfloat16):
        frozen(torch.tanh(layer(x))).float().square().sum().backward()
    weight_shapes = {(8, 16), (16, 8), (4, 8), (8, 4)}
    assert auto.stats.tensors > 0
    assert not weight_shapes.intersection(r[0] for r in auto.stats.records), auto.stats.records

    twice, x.grad = ActivationOffload(min_bytes=0), None
    with twice:
        y = x.exp()  # exp saves its output y
        z = y * y  # mul saves y twice more: the first copy serves all three
    z.sum().backward()
    assert (twice.stats.tensors, twice.stats.shared) == (1, 2)
    assert torch.equal(x.grad, 2 * x.detach().exp() ** 2)

    a = torch.randn(4, requires_grad=True)
    keep = ActivationOffload(min_bytes=1 << 30)
    with keep:
        b = a * 2
        c = b.sin()
    b.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        c.sum().backward()
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffload(min_bytes=-1)


def test_the_fused_heads_saved_tensors_do_not_overlap():
    """The fused head keeps logit tiles for backward, views of its tile block: saved beside the
    block, each of their bytes was offloaded twice. Every byte is saved once, gradients equal."""
    from microrl.kernels import fused_linear_logprob

    torch.manual_seed(0)
    hidden = torch.randn(48, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (48,))
    spans: list[tuple[int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
            spans.append((start, start + extent * t.element_size()))
        return t

    def run(hooks):
        hidden.grad = weight.grad = None
        with hooks:
            logprob, entropy = fused_linear_logprob(hidden, weight, targets, chunk_size=16)
        (logprob.sum() + 0.5 * entropy.sum()).backward()
        return hidden.grad.clone(), weight.grad.clone()

    expected = run(nullcontext())
    got = run(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    spans.sort()
    overlaps = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
    assert len(spans) > 8 and not overlaps, overlaps  # the block and its kept tiles are saved
    offloaded = run(ActivationOffload(min_bytes=0))
    assert all(torch.equal(a, b) for a, b in zip((*got, *offloaded), expected * 2, strict=True))


def test_config_key_and_validation():
    cfg = load_config(GRPOExampleConfig, None, ["actor.activation_offload=true"])
    assert cfg.actor.activation_offload is True
    assert ActorConfig().activation_offload is False
    with pytest.raises(ValueError, match="activation_offload"):
        ActorConfig(activation_offload="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA copies and streams need a GPU")
@pytest.mark.parametrize("ckpt", [False, True], ids=["no_ckpt", "ckpt"])
def test_cuda_copies_free_the_device_and_keep_gradients(ckpt):
    """On a GPU (not in the CPU CI): pinned copies on the side stream, prefetched back in
    backward. The activations leave the device during the forward, the gradients are the same
    bytes (the copies are exact; the kernels see the same inputs), with and without
    checkpointing (non-reentrant, as the engine uses it)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    rows, width, depth = 2048, 1024, 8  # [rows, width] fp32 activations: 8 MiB each
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
    ).cuda()
    x = torch.randn(rows, width, device="cuda", requires_grad=True)

    def run(hooks):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with hooks:
            y = x
            for block in blocks:
                y = checkpoint(block, y, use_reentrant=False) if ckpt else block(y)
            loss = y.square().mean()
        del y
        held = torch.cuda.memory_allocated() - before  # what the graph keeps on the device
        loss.backward()
        torch.cuda.synchronize()
        return held, [t.grad.clone() for t in (x, *blocks.parameters())]

    held, want = run(nullcontext())
    hooks = ActivationOffload([*blocks.parameters()])
    held_offloaded, got = run(hooks)
    assert hooks.stats.tensors >= (depth if ckpt else 2 * depth)
    assert held_offloaded < held / 4, (held_offloaded, held)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)

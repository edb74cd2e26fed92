"""Vision-language models through the engine (engine/vision.py, docs/engine.md#images).

Tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL from configs (tests/engine/vision_utils.py), float64 so
that exactness is checked to rounding: log-probs against the model's own forward row by row;
fused == eager head, values and gradients, with the vision tower trainable and frozen; the
same loss, outputs and gradients under micro-batch splits, token budgets and packing; LoRA on
the language model only; the freeze_vision audit both ways; bad input named by row and field.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from vision_utils import IMAGE_TOKEN, image_row, make_image_batch, tiny_vlm

from microrl import ActorEngine, CriticEngine
from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig
from microrl.engine.vision import ROPE_KEY, image_store, pad_images

# Engine outputs are float32 (docs/batch.md): a float64 model's log-probs agree to fp32 rounding.
OUT_TOL = 2e-6
# Gradients stay float64 inside: two exact computations of one float64 quantity.
GRAD_TOL = 1e-10


@torch.no_grad()
def model_logprobs(model, batch) -> torch.Tensor:
    """Token-aligned log-probs from the model's own forward (its head, its mRoPE), row by row."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for b in range(batch.batch_size[0]):
        keep = batch["attention_mask"][b]
        ids = batch["input_ids"][b][keep][None]
        grid = batch["image_grid_thw"][b]
        grid = grid[grid.prod(-1) > 0]
        images = {}
        if len(grid):
            store, index = image_store(batch)
            images = dict(
                pixel_values=store[index[b], : int(grid.prod(-1).sum())],
                image_grid_thw=grid,
                mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
            )
        logp = torch.log_softmax(model(input_ids=ids, **images).logits[0].double(), -1)
        cols = keep.nonzero()[:, 0]
        out[b, cols[1:]] = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return out


def actor(model, **overrides) -> ActorEngine:
    kwargs = dict(micro_batch_size=2, lora=LoraConfig(rank=0), check_grad_flow="error")
    return ActorEngine(model, ActorConfig(**{**kwargs, **overrides}))


def grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = (a.double() - b.double()).abs()
    assert err.max() <= tol, (
        f"{what}: max |diff| {err.max():.3g} at {divmod(int(err.argmax()), a.shape[-1])}"
    )


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_logprobs_match_the_models_own_forward(arch):
    model = tiny_vlm(arch, dtype=torch.float64)
    batch = make_image_batch(dtype=torch.float64)
    engine = actor(model, pack_sequences=arch != "qwen2_vl")
    assert engine.uses_fused_kernel
    out = engine.infer_batch(batch)["logprobs"]
    assert_close(out, model_logprobs(model, batch), OUT_TOL, arch)
    assert (out[~batch["attention_mask"]] == 0).all()


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trainable"])
def test_fused_equals_eager_logprobs_and_gradients(freeze):
    model = tiny_vlm("qwen2_vl", dtype=torch.float64)
    batch = make_image_batch(dtype=torch.float64)
    results = []
    for fused in (True, False):
        engine = actor(copy.deepcopy(model), use_fused_kernel=fused, freeze_vision=freeze)
        out = engine.forward_backward_batch(batch)
        results.append((out, grads(engine), engine))
    (fused_out, fused_grads, engine), (eager_out, eager_grads, _) = results
    assert not engine.uses_fused_kernel or engine.config.use_fused_kernel
    assert_close(
        fused_out["model_output"]["logprobs"],
        eager_out["model_output"]["logprobs"],
        OUT_TOL,
        "logprobs",
    )
    assert abs(fused_out["loss"] - eager_out["loss"]) < 1e-6
    assert fused_grads.keys() == eager_grads.keys()
    for name, g in fused_grads.items():
        assert_close(g, eager_grads[name], GRAD_TOL, name)
    tower = [n for n in fused_grads if ".visual." in n]
    if freeze:
        assert not tower
        assert all(p.grad is None for p in engine.vision.tower.parameters())
    else:  # every tower weight trains, and is reached by the images
        assert len(tower) == len(list(engine.vision.tower.parameters()))
        assert all(fused_grads[n].abs().max() > 0 for n in tower)


SPLITS = {
    "one_row_per_micro_batch": dict(micro_batch_size=1),
    "token_budget": dict(micro_batch_size=None, max_tokens_per_micro_batch=40),
    "packed_budget": dict(
        micro_batch_size=None, max_tokens_per_micro_batch=40, pack_sequences=True
    ),
    "checkpointed_packed": dict(pack_sequences=True, gradient_checkpointing=True),
}


@pytest.fixture(scope="module")
def split_reference():
    """The whole mini-batch in one micro-batch: model, batch, loss, outputs, gradients."""
    model = tiny_vlm("qwen2_5_vl", dtype=torch.float64)
    batch = make_image_batch(dtype=torch.float64)
    whole = actor(copy.deepcopy(model), micro_batch_size=6, freeze_vision=False)
    return model, batch, whole.forward_backward_batch(batch), grads(whole)


@pytest.mark.parametrize("split", list(SPLITS))
def test_exact_under_micro_batch_splits_and_packing(split_reference, split):
    model, batch, ref, ref_grads = split_reference
    engine = actor(copy.deepcopy(model), freeze_vision=False, **SPLITS[split])
    out = engine.forward_backward_batch(batch)
    assert abs(out["loss"] - ref["loss"]) < 1e-9
    assert_close(out["model_output"]["logprobs"], ref["model_output"]["logprobs"], OUT_TOL, split)
    got = grads(engine)
    assert got.keys() == ref_grads.keys()
    for name, g in got.items():
        assert_close(g, ref_grads[name], GRAD_TOL, name)


def test_critic_values_exact_under_packing_and_splits():
    model = tiny_vlm("qwen2_vl", dtype=torch.float64)
    batch = make_image_batch(dtype=torch.float64)
    values = []
    for overrides in (dict(micro_batch_size=6), dict(micro_batch_size=1, pack_sequences=True)):
        config = CriticConfig(lora=LoraConfig(rank=0), freeze_vision=False, **overrides)
        engine = CriticEngine(copy.deepcopy(model), config)
        out = engine.forward_backward_batch(batch)
        values.append((out["model_output"]["values"], out["loss"], grads(engine)))
    (v0, l0, g0), (v1, l1, g1) = values
    assert_close(v0, v1, OUT_TOL, "values")
    assert abs(l0 - l1) < 1e-9
    assert any(".visual." in n for n in g0)
    for name, g in g0.items():
        assert_close(g, g1[name], GRAD_TOL, name)


def test_rope_positions_are_the_models_own_and_padding_invariant():
    engine = actor(tiny_vlm("qwen2_vl"))
    batch = make_image_batch()
    checked = engine._checked(batch, None, True, role_checks=True)
    rope = checked[ROPE_KEY]  # [B, T, 3]
    assert rope.shape == (*batch["input_ids"].shape, 3)
    row = 2  # two images: h/w positions differ from the text positions inside them
    keep = batch["attention_mask"][row]
    ids = batch["input_ids"][row][keep][None]
    grid = batch["image_grid_thw"][row]
    own, _ = engine.vision.body.get_rope_index(
        ids, (ids == IMAGE_TOKEN).int(), image_grid_thw=grid[grid.prod(-1) > 0]
    )
    assert torch.equal(rope[row][keep].T, own[:, 0])
    assert not torch.equal(own[1], own[2])


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trainable"])
def test_lora_targets_the_language_model_unless_the_tower_trains(freeze):
    # Qwen2.5-VL's tower MLP has the language model's layer names (gate_proj, up_proj, ...).
    # (No audit here: lora_B starts at 0, so lora_A gets no gradient on the first step.)
    config = dict(lora=LoraConfig(rank=4), freeze_vision=freeze, check_grad_flow=False)
    engine = actor(tiny_vlm("qwen2_5_vl"), **config)
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert any("language_model" in n and "lora_" in n for n in trainable)
    in_tower = [n for n in trainable if ".visual." in n]
    assert all("lora_" in n for n in in_tower)
    assert bool(in_tower) is not freeze
    engine.forward_backward_batch(make_image_batch())
    got = grads(engine)
    assert set(got) == set(trainable)
    assert all(got[n].abs().max() > 0 for n in in_tower if "lora_B" in n)


def test_freeze_vision_audit_catches_a_tower_that_trains_while_frozen():
    engine = actor(tiny_vlm("qwen2_vl"))
    engine.forward_backward_batch(make_image_batch())
    leaked = next(iter(engine.vision.tower.parameters()))
    leaked.requires_grad_(True)
    with pytest.raises(
        RuntimeError, match=r"actor.freeze_vision=True, but vision tower .*patch_embed"
    ):
        engine.forward_backward_batch(make_image_batch())


def test_freeze_vision_audit_catches_a_tower_that_stays_frozen_while_training():
    engine = actor(tiny_vlm("qwen2_vl"), freeze_vision=False)
    engine.forward_backward_batch(make_image_batch())
    text_only = make_image_batch(([], [(1, 2, 2)]))[:1]  # row 0 only: no image
    del text_only["pixel_values"], text_only["image_grid_thw"], text_only["image_index"]
    engine.forward_backward_batch(text_only)  # no image anywhere: the tower is not expected
    # The features detached from the tower: images in the batch, yet no gradient reaches it.
    merger = engine.vision.tower.merger
    handle = merger.register_forward_hook(lambda m, a, out: out.detach())
    engine.optimizer.zero_grad(set_to_none=True)  # forward_backward_batch accumulates
    with pytest.raises(RuntimeError, match=r"without gradient: .*visual"):
        engine.forward_backward_batch(make_image_batch())
    handle.remove()
    engine.vision.tower.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"actor.freeze_vision=False, but no vision tower"):
        engine.forward_backward_batch(make_image_batch())


def _more_tokens(batch):
    row = batch["input_ids"][0]
    first = int((row == IMAGE_TOKEN).nonzero()[0, 0])
    row[first - 1] = IMAGE_TOKEN  # the vision-start token becomes one more placeholder


def _missing_pixels(batch):
    batch["image_grid_thw"][2] = 0


def _loss_on_image(batch):
    batch["loss_mask"][0] |= batch["input_ids"][0] == IMAGE_TOKEN


BAD = {
    "more_tokens_than_features": (_more_tokens, r"row 0: input_ids holds 2 image token.*gives 1"),
    "row_missing_pixel_values": (_missing_pixels, r"row 2: .* no image: its 'pixel_values'"),
    "no_image_keys": (
        lambda b: b.del_("pixel_values").del_("image_grid_thw").del_("image_index"),
        r"row 0: .*no 'pixel_values'",
    ),
    "grid_without_pixels": (
        lambda b: b.del_("pixel_values"),
        r"'image_grid_thw' but no 'pixel_values'",
    ),
    "wrong_patch_size": (
        lambda b: b.set("pixel_values", b["pixel_values"][..., :5]),
        r"'pixel_values' must be a float tensor \[G, P, 24\] \(the pixel store\)",
    ),
    "loss_on_image_token": (_loss_on_image, "loss_mask marks an image placeholder token"),
    "rope_given": (
        lambda b: b.set(ROPE_KEY, torch.zeros(*b["input_ids"].shape, 3, dtype=torch.long)),
        "computed by the engine",
    ),
    "non_finite_pixels": (
        lambda b: b["pixel_values"][b["image_index"][3]].fill_(float("nan")),
        r"row 3: 'pixel_values' is not finite",
    ),
}


@pytest.fixture(scope="module")
def vlm_engine():
    return actor(tiny_vlm("qwen2_vl"))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_input_names_the_row_and_field(vlm_engine, case):
    batch = make_image_batch()
    edit, message = BAD[case]
    edit(batch)
    with pytest.raises(ValueError, match=message):
        vlm_engine.forward_backward_batch(batch)


def test_a_transformers_that_would_drop_the_image_features_is_refused(monkeypatch):
    """transformers 5.17's Qwen-VL bodies take no ``mm_encoder_outputs``: the features the
    engine computes would vanish into ``**kwargs`` and the model train on placeholder embeddings
    (measured: the toy vision warm start stuck at chance on a GPU machine). Refused by name."""
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    def forward_of_5_17(self, input_ids=None, pixel_values=None, **kwargs):
        raise AssertionError("never called")

    monkeypatch.setattr(modeling_qwen2_vl.Qwen2VLModel, "forward", forward_of_5_17)
    with pytest.raises(TypeError, match=r"no mm_encoder_outputs .* transformers >= 5\.18"):
        ActorEngine(tiny_vlm("qwen2_vl"), ActorConfig())


def test_bad_vision_config_names_the_key():
    from engine_utils import tiny_model

    with pytest.raises(ValueError, match="freeze_vision must be a bool"):
        ActorConfig(freeze_vision="yes")
    with pytest.raises(
        ValueError, match=r"actor.freeze_vision=False, but Qwen2ForCausalLM has no vision"
    ):
        ActorEngine(tiny_model(), ActorConfig(freeze_vision=False))
    with pytest.raises(ValueError, match=r"actor.sequence_parallel_size=2 is not supported"):
        ActorEngine(tiny_vlm("qwen2_vl"), ActorConfig(sequence_parallel_size=2))
    with pytest.raises(ValueError, match=r"critic.tensor_parallel_size=2 is not supported"):
        CriticEngine(tiny_vlm("qwen2_vl"), CriticConfig(tensor_parallel_size=2))
    text = ActorEngine(tiny_model(), ActorConfig())
    with pytest.raises(ValueError, match="the model has no vision tower"):
        text.infer_batch(
            {"input_ids": torch.ones(1, 3, dtype=torch.long), "pixel_values": torch.zeros(1, 4, 24)}
        )


def test_pad_images_lays_out_rows_and_rejects_mismatched_patches():
    one = (torch.randn(4, 24), torch.tensor([[1, 2, 2]]))
    two = (torch.randn(12, 24), torch.tensor([[1, 2, 2], [1, 2, 4]]))
    keys = pad_images([one, None, two, two, one])  # rows 2-3 and 0, 4 share their images
    assert keys["pixel_values"].shape == (2, 12, 24) and keys["image_grid_thw"].shape == (5, 2, 3)
    assert keys["image_index"].tolist() == [0, -1, 1, 1, 0]
    assert (
        torch.equal(keys["pixel_values"][0, :4], one[0]) and not keys["pixel_values"][0, 4:].any()
    )
    assert torch.equal(keys["pixel_values"][1], two[0]) and not keys["image_grid_thw"][1].any()
    assert torch.equal(keys["image_grid_thw"][3], two[1]) and not keys["image_grid_thw"][0, 1].any()
    with pytest.raises(ValueError, match=r"row 1: image_grid_thw \[\[1, 2, 2\]\] gives 4 patches"):
        pad_images([one, (torch.randn(5, 24), one[1])])
    with pytest.raises(ValueError, match="at least one row with images"):
        pad_images([None, None])


def _grouped_batch(group: int = 3) -> tuple[TensorDict, TensorDict]:
    """Two prompts with images (one and two of them), ``group`` rows each sharing their
    prompt's pixel tensors, plus a text row: ``(shared, per_row)``, the same rows in the
    rollouts' layout (one store entry per prompt, ``image_index``) and in the per-row one."""
    gen = torch.Generator().manual_seed(7)
    prompts = [image_row(gen, grids, 2, 3) for grids in ([(1, 2, 2)], [(1, 4, 2), (1, 2, 2)], [])]
    rows = [p for p in prompts[:2] for _ in range(group)] + [prompts[2]]
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, (row_ids, start, _) in enumerate(rows):
        ids[b, : len(row_ids)] = torch.tensor(row_ids)
        mask[b, : len(row_ids)] = True
        loss_mask[b, start : len(row_ids)] = True
    text = dict(input_ids=ids, attention_mask=mask, loss_mask=loss_mask)
    shared = TensorDict(**text, **pad_images([r[2] for r in rows]), batch_size=[len(rows)])
    store, index = image_store(shared)
    per_row = store[index.clamp_min(0)] * (index >= 0)[:, None, None]
    flat = TensorDict(
        **text,
        pixel_values=per_row,
        image_grid_thw=shared["image_grid_thw"],
        batch_size=[len(rows)],
    )
    return shared, flat


@pytest.mark.parametrize("split", ["one_row_per_micro_batch", "packed_budget"])
def test_a_groups_rows_share_one_copy_of_their_pixels(split):
    """A rollout's layout holds each prompt's pixels once for its group (here 2 entries for 7
    rows, a third of the per-row bytes) and trains exactly as the per-row layout does, under
    any split: the engine gathers each micro-batch's rows from the store."""
    shared, per_row = _grouped_batch(group=3)
    assert shared["pixel_values"].shape[0] == 2 and shared["image_index"].tolist() == [
        0, 0, 0, 1, 1, 1, -1
    ]  # fmt: skip
    assert shared["pixel_values"].numel() * 3 <= per_row["pixel_values"].numel()
    model = tiny_vlm("qwen2_vl", dtype=torch.float64)
    results = []
    for batch in (shared, per_row):
        engine = actor(copy.deepcopy(model), freeze_vision=False, **SPLITS[split])
        batch = batch.clone()
        batch["advantages"] = torch.linspace(-1, 1, batch["input_ids"].numel()).view_as(
            batch["loss_mask"]
        ).double()  # fmt: skip
        batch["old_logprobs"] = torch.zeros_like(batch["advantages"])
        results.append((engine.forward_backward_batch(batch), grads(engine)))
    (out, got), (ref, want) = results
    assert_close(out["model_output"]["logprobs"], ref["model_output"]["logprobs"], OUT_TOL, split)
    assert got.keys() == want.keys() and any(".visual." in n for n in got)
    for name, g in got.items():
        assert_close(g, want[name], GRAD_TOL, name)


def test_bad_image_index_names_the_row():
    shared, _ = _grouped_batch()
    engine = actor(tiny_vlm("qwen2_vl"))
    for value, message in (
        (5, r"row 1: 'image_index' is 5, but 'pixel_values' holds 2 entries"),
        (-1, r"row 1: 'image_index' is -1, but 'pixel_values' holds 2 entries"),
    ):
        batch = shared.clone()
        batch["image_index"][1] = value
        with pytest.raises(ValueError, match=message):
            engine.infer_batch(batch)
    batch = shared.clone()
    batch["image_index"] = batch["image_index"].float()
    with pytest.raises(ValueError, match=r"'image_index' must be an integer tensor \[B\]"):
        engine.infer_batch(batch)

"""Routing replay (docs/engine.md#mixture-of-experts): a batch's ``routed_experts`` routes every
token through its recorded experts with the trainer's own gate weights over them; the recorder
a sampler wraps around its forwards; the agreement metric; gradient checkpointing."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch
from moe_utils import (
    NUM_EXPERTS,
    NUM_LAYERS,
    TOP_K,
    forced_router_forward,
    positions,
    router_modules,
    tiny_moe,
)

from microrl.configs import ActorConfig, OptimConfig
from microrl.engine import ActorEngine
from microrl.engine.moe import ROUTED_EXPERTS_KEY, RoutingRecorder
from microrl.losses import RouterLossConfig

SGD = OptimConfig(name="sgd", lr=1.0, grad_clip=None)
# float64 models; Qwen3-MoE's gate weights pass through its float32 softmax in both paths.
ATOL = 1e-6


def _batch():
    return make_batch(5, 10, padding="mixed", seed=6, dtype=torch.float64)


def _random_routes(batch, seed: int = 0) -> torch.Tensor:
    """k distinct random experts per token and layer, int16 ``[B, T, L, k]``."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = batch["input_ids"].shape
    scores = torch.rand(rows, cols, NUM_LAYERS, NUM_EXPERTS, generator=g)
    return scores.argsort(-1)[..., :TOP_K].to(torch.int16)


def _recorded(model, batch) -> torch.Tensor:
    """The routing ``model`` chooses for ``batch`` in one padded forward, as a sampler records it."""
    mask = batch["attention_mask"]
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(input_ids=batch["input_ids"], attention_mask=mask.long(),
              position_ids=positions(mask), use_cache=False)  # fmt: skip
    return recorder.routes(batch.batch_size[0])


def _forced_logprobs(model, batch, routes) -> torch.Tensor:
    """Row by row, every router forced to ``routes`` (``[B, T, L, k]``) by the test's own
    reimplementation of the family's gating: token-aligned log-probs with their graph."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for b in range(batch.batch_size[0]):
        cols = batch["attention_mask"][b].nonzero().squeeze(1)
        row = batch["input_ids"][b, cols][None]
        for layer, router in enumerate(router_modules(model)):
            router.forward = forced_router_forward(router, routes[b, cols, layer].long())
        try:
            logits = model(input_ids=row, use_cache=False).logits[0]
        finally:
            for router in router_modules(model):
                del router.forward
        logp = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, row[0, 1:, None])
        out = out.index_put((torch.tensor(b), cols[1:]), logp.squeeze(-1))
    return out


def _sft(logprobs, batch) -> torch.Tensor:
    return -(logprobs * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def _engine(family, **overrides):
    config = ActorConfig(**{"micro_batch_size": 2, "optim": SGD, **overrides})
    return ActorEngine(tiny_moe(family, dtype=torch.float64), config)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "olmoe"])
def test_replay_equals_a_forward_forcing_the_recorded_experts(family):
    """Log-probs and gradients (the routers' included: they still train) of the engine under
    replay equal the model's forward with its routers forced to the same experts."""
    batch = _batch()
    batch[ROUTED_EXPERTS_KEY] = routes = _random_routes(batch)
    reference = tiny_moe(family, dtype=torch.float64)
    expected = _forced_logprobs(reference, batch, routes)
    _sft(expected, batch).backward()
    expected_grads = {f"causal_lm.{n}": p.grad for n, p in reference.named_parameters()}
    engine = _engine(family, pack_sequences=family == "gpt_oss")
    mask = batch["attention_mask"]
    got = engine.infer_batch(batch)["logprobs"]
    torch.testing.assert_close(got[mask], expected.detach()[mask].float(), atol=ATOL, rtol=0)
    engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)
    grads = grads_of(engine.module)
    assert all(grads[f"causal_lm.{r}.weight"].abs().sum() > 0 for r in _router_names(reference))
    assert_close_dicts(grads, expected_grads, rtol=0, atol=ATOL)


def _router_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_replaying_the_models_own_routing_changes_nothing(family):
    batch = _batch()
    plain = _engine(family)
    expected = plain.forward_backward_batch(batch, loss_fn=plain.sft_loss)
    batch[ROUTED_EXPERTS_KEY] = _recorded(tiny_moe(family, dtype=torch.float64), batch)
    replay = _engine(family)
    got = replay.forward_backward_batch(batch, loss_fn=replay.sft_loss)
    assert got["metrics"].pop("router/agreement") == 1.0
    assert got["metrics"].pop("router/routed_as_sampled") == 1.0
    assert got["metrics"] == pytest.approx(expected["metrics"], rel=1e-9)
    torch.testing.assert_close(
        got["model_output"]["logprobs"], expected["model_output"]["logprobs"], atol=1e-9, rtol=0
    )
    assert_close_dicts(grads_of(replay.module), grads_of(plain.module), rtol=0, atol=1e-9)


def test_a_drifted_router_disagrees_and_replay_routes_as_the_sampler():
    """The sampler ran other router weights (a drifted policy): not every recorded top-k is the
    trainer's own (``router/agreement`` < 1, the same with replay on or off: it compares the
    trainer's router with the record). Without replay the trainer routes its own way
    (``router/routed_as_sampled`` is that agreement); with it, every token goes through the
    sampler's experts (1.0) and its log-probs are those of its weights forced to them."""
    batch = _batch()
    sampler = tiny_moe("qwen3_moe", dtype=torch.float64)
    with torch.no_grad():
        for router in router_modules(sampler):
            router.weight.add_(torch.randn_like(router.weight) * 0.2)
    batch[ROUTED_EXPERTS_KEY] = routes = _recorded(sampler, batch)
    forced = _forced_logprobs(tiny_moe("qwen3_moe", dtype=torch.float64), batch, routes).detach()
    mask = batch["attention_mask"]
    agreement, routed, gap = {}, {}, {}
    for replay in (False, True):
        engine = _engine("qwen3_moe", routing_replay=replay)
        result = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss, forward_only=True)
        agreement[replay] = result["metrics"]["router/agreement"]
        routed[replay] = result["metrics"]["router/routed_as_sampled"]
        gap[replay] = (result["model_output"]["logprobs"] - forced)[mask].abs().max().item()
    assert 0.5 < agreement[True] == agreement[False] < 1.0
    assert routed == {True: 1.0, False: pytest.approx(agreement[False])}
    assert gap[True] < ATOL < 100 * ATOL < gap[False], gap


def test_replay_with_the_aux_loss_counts_the_recorded_experts_for_any_split():
    """Under replay the load fractions come from the key (no counting pass): the aux loss is
    ``E * sum_e f_e P_e`` with ``f`` the recorded assignments, the same for any split."""
    batch = _batch()
    batch[ROUTED_EXPERTS_KEY] = routes = _random_routes(batch, seed=3)
    real = batch["attention_mask"]
    counts = torch.stack([(routes[real].long() == e).sum() for e in range(NUM_EXPERTS)])
    load = counts.double() / (real.sum() * NUM_LAYERS)
    reference = tiny_moe("qwen3_moe", dtype=torch.float64)
    probs = []  # the router's softmax of every real token, under the replayed routing
    hooks = [r.register_forward_hook(lambda m, a, o: probs.append(torch.softmax(o[0], -1)))
             for r in router_modules(reference)]  # fmt: skip
    _forced_logprobs(reference, batch, routes)
    for hook in hooks:
        hook.remove()
    share = torch.cat(probs).sum(0) / (real.sum() * NUM_LAYERS)
    expected = float(NUM_EXPERTS * (load * share.detach()).sum())
    values, grads = [], []
    for split in ({"micro_batch_size": 1}, {"micro_batch_size": 5}):
        engine = _engine("qwen3_moe", router_loss=RouterLossConfig(aux_loss_coef=1.0), **split)
        result = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)
        values.append(result["metrics"]["router/aux_loss"])
        grads.append(grads_of(engine.module))
    assert values == pytest.approx([expected, expected], rel=1e-6)
    assert_close_dicts(grads[0], grads[1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("call", ["forward_step", "forward_backward_batch"])
def test_checkpointed_layers_recompute_with_the_replayed_routing(call):
    """Gradient checkpointing recomputes each layer in the backward: inside the pass, or (a
    direct ``forward_step`` then the caller's ``backward``) after the step returned. Either way
    it must route as the forward did."""
    batch = _batch()
    batch[ROUTED_EXPERTS_KEY] = _random_routes(batch, seed=1)
    grads = {}
    for checkpointing in (False, True):
        engine = _engine("qwen3_moe", gradient_checkpointing=checkpointing)
        if call == "forward_step":
            engine.forward_step(batch, loss_fn=engine.sft_loss).loss.backward()
        else:
            engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)
        grads[checkpointing] = grads_of(engine.module)
        engine.infer_batch(make_batch(2, 6, seed=9, dtype=torch.float64))  # hooks reset, no key
    assert_close_dicts(grads[True], grads[False], rtol=0, atol=1e-12)


def test_the_recorder_records_every_token_generate_fed_to_the_model():
    """``generate`` (a prefill, then a step per token): the recorded routing of each fed token is
    the routing one forward over the whole sequences chooses; the last token is never fed (-1)."""
    model = tiny_moe("gpt_oss", dtype=torch.float64).eval()
    prompts = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        sequences = model.generate(prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)
    routes = recorder.routes(3, sequences.shape[1])
    assert routes.shape == (3, 9, NUM_LAYERS, TOP_K) and routes.dtype == torch.int16
    assert (routes[:, -1] == -1).all() and (routes[:, :-1] >= 0).all()
    with torch.no_grad(), RoutingRecorder(model) as whole:
        model(input_ids=sequences, use_cache=False)
    expected = whole.routes(3)[:, :-1]
    assert torch.equal(routes[:, :-1].sort(-1).values, expected.sort(-1).values)
    with pytest.raises(ValueError, match="not a multiple of batch_size=2"):
        whole.routes(2)

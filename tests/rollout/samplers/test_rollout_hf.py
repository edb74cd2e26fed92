"""The transformers rollout backend (microrl/rollout/samplers/hf.py, the layout of microrl/rollout/layout.py).

A rollout batch is token-aligned (the loss covers each response up to its first ``<eos>``, never the
prompt or the padding), and ``HFRollout``
samples from the distribution the engine scores: the first on-policy ratio is 1.
"""

from __future__ import annotations

import copy

import pytest
import torch

from microrl.configs.run import ModelConfig
from microrl.rollout import HFRollout, SamplingParams
from microrl.run.toy_model import build_model, build_tokenizer


def test_rollout_layout_is_token_aligned() -> None:
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    torch.manual_seed(0)
    params = SamplingParams(num_samples=3, max_new_tokens=4)
    rollout = HFRollout(model, tok).generate(["1+2=", "34+56="], params)
    batch = rollout.batch
    assert batch.batch_size == torch.Size([6]) and rollout.group_ids.tolist() == [
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    prompt_width = tok(["1+2=", "34+56="], padding=True, return_tensors="pt")["input_ids"].shape[1]
    assert prompt_width < batch["input_ids"].shape[1] <= prompt_width + 4
    mask, attention, ids = batch["loss_mask"], batch["attention_mask"], batch["input_ids"]
    assert not mask[:, :prompt_width].any()
    assert (mask <= attention).all()
    for row in range(6):
        response = ids[row, prompt_width:][mask[row, prompt_width:]]
        eos = (response == tok.eos_token_id).nonzero()
        # the loss covers the response up to and including its first <eos>, nothing after
        assert eos.numel() <= 1 and (eos.numel() == 0 or eos.item() == len(response) - 1)
        assert rollout.texts[row] == tok.decode(response, skip_special_tokens=True)


def test_sampling_distribution_is_the_one_the_engine_scores() -> None:
    """Log-probs of the sampled tokens under ``generate`` equal the engine's: ratio 1 at step 1."""
    from microrl.configs import ActorConfig, LoraConfig
    from microrl.engine import ActorEngine

    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    engine = ActorEngine(model, ActorConfig(temperature=0.7, lora=LoraConfig(rank=2)))
    torch.manual_seed(0)
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=4)
    rollout = HFRollout(engine, tok).generate(["1+2=", "34+56="], params)
    batch = rollout.batch
    logprobs = engine.infer_batch(batch)["logprobs"]
    # Reference: the model's own logits at the sampling temperature, token-aligned.
    with torch.no_grad():
        am = batch["attention_mask"].long()
        logits = engine.model(
            input_ids=batch["input_ids"],
            attention_mask=am,
            position_ids=(am.cumsum(-1) - 1).clamp(min=0),
        ).logits
    ref = (logits[:, :-1] / 0.7).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:]
    torch.testing.assert_close(logprobs[:, 1:][mask], ref[mask], atol=1e-5, rtol=1e-5)


# Measured max |rollout_logprobs - engine logprobs| of HF's sampled tokens: a few 1e-6 on the toy
# models (generate's KV-cached forward rounds differently from the engine's full-sequence pass);
# the bound leaves a margin. docs/losses.md#bypass-mode-bypass_mode.
HF_LOGPROB_ATOL = 5e-5


def test_bypass_step_equals_the_recomputed_step() -> None:
    """``policy_loss.bypass_mode`` anchors the ratio on HF's ``rollout_logprobs`` instead of the
    engine's recomputed ``old_logprobs``: the same model at the same weights, so the step's loss
    and gradients equal the recomputed step's to the log-probs' fp32 difference."""
    from microrl.configs import ActorConfig, LoraConfig
    from microrl.engine import ActorEngine
    from microrl.losses import PolicyLossConfig

    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )

    def engine(bypass: bool) -> ActorEngine:
        torch.manual_seed(0)  # the same LoRA initialisation in both
        config = ActorConfig(
            micro_batch_size=4,
            temperature=0.7,
            lora=LoraConfig(rank=4),
            policy_loss=PolicyLossConfig(name="grpo", bypass_mode=bypass),
        )
        built = ActorEngine(copy.deepcopy(model), config)
        with torch.no_grad():  # a non-trivial adapter: the policy is not the base model
            generator = torch.Generator().manual_seed(1)
            for name, param in built.module.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        return built

    recompute, bypass = engine(False), engine(True)
    torch.manual_seed(0)
    params = SamplingParams(num_samples=4, temperature=0.7, max_new_tokens=4)
    rollout = HFRollout(recompute, tok).generate(["1+2=", "34+56=", "7+8=", "99+9="], params)
    batch, mask = rollout.batch, rollout.batch["loss_mask"]
    batch["advantages"] = torch.randn(mask.shape) * mask
    old = recompute.infer_batch(batch)["logprobs"]
    worst = (old - batch["rollout_logprobs"])[mask].abs().max().item()
    assert worst <= HF_LOGPROB_ATOL, f"max |rollout - engine| log-prob {worst:.3g}"

    expected = recompute.forward_backward_batch(batch.update({"old_logprobs": old}))
    got = bypass.forward_backward_batch(batch.exclude("old_logprobs"))
    assert abs(got["loss"] - expected["loss"]) <= HF_LOGPROB_ATOL * 1e-2 + 1e-7
    grads = {n: p.grad for n, p in bypass.module.named_parameters() if p.requires_grad}
    for name, param in recompute.module.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-4)
    # The mismatch metrics compare the sampler with the current pass, at the sampling weights
    # here: the same gap the recomputed old log-probs show.
    for key in ("mismatch/abs_diff_mean", "mismatch/abs_diff_max"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], abs=1e-6)
    assert got["metrics"]["mismatch/abs_diff_max"] == pytest.approx(worst, abs=1e-6)


def test_build_rollout_equals_a_row_by_row_layout() -> None:
    """The vectorised layout against the obvious per-row one: uneven prompts, responses cut at
    their first <eos>, responses without one (truncated), an empty response."""
    from microrl.rollout import Samples, build_rollout

    gen = torch.Generator().manual_seed(0)
    eos, pad = 2, 0
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    token_ids = [torch.randint(3, 9, (int(n),), generator=gen).tolist() for n in [4, 1, 6, 3, 5, 2]]
    token_ids[0][1] = eos  # cut after position 1; the rest is padding
    token_ids[2][5] = eos
    token_ids[4] = [eos, 4, eos]
    token_ids[5] = []
    logprobs = [(-torch.rand(len(t), generator=gen)).tolist() for t in token_ids]
    batch = build_rollout(
        prompts, Samples(token_ids, logprobs), num_samples=2, eos_token_id=eos, pad_token_id=pad
    )
    kept = [t[: t.index(eos) + 1] if eos in t else t for t in token_ids]
    width = 5 + max(len(k) for k in kept)
    for row, (response, lps) in enumerate(zip(kept, logprobs, strict=True)):
        prompt = prompts[row // 2]
        ids = [pad] * (5 - len(prompt)) + prompt + response
        ids += [pad] * (width - len(ids))
        assert batch["input_ids"][row].tolist() == ids
        attention = [0] * (5 - len(prompt)) + [1] * (len(prompt) + len(response))
        assert batch["attention_mask"][row].tolist() == attention + [0] * (width - len(attention))
        loss = [0] * 5 + [1] * len(response)
        assert batch["loss_mask"][row].tolist() == loss + [0] * (width - len(loss))
        expected = [0.0] * 5 + lps[: len(response)]
        expected += [0.0] * (width - len(expected))
        assert batch["rollout_logprobs"][row].tolist() == pytest.approx(expected)
    assert batch["truncated"].tolist() == [eos not in t for t in token_ids]
    assert batch["attention_mask"].dtype == batch["loss_mask"].dtype == torch.bool


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generate_samples_at_the_engine_precision(dtype, monkeypatch) -> None:
    """``generate`` runs under the engine's autocast (bf16 here, as on CUDA by default), so the
    sampler's precision is the trainer's; a float32 engine samples without autocast."""
    from microrl.configs import ActorConfig
    from microrl.engine import ActorEngine

    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    engine = ActorEngine(model, ActorConfig(dtype=dtype))
    seen = []
    generate = engine.model.generate

    def spying(*args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine.model, "generate", spying)
    rollout = HFRollout(engine, tok).generate(["1+2="], SamplingParams(max_new_tokens=3, seed=1))
    assert rollout.batch["rollout_logprobs"].dtype == torch.float32
    expected = (True, torch.bfloat16) if dtype == "bfloat16" else (False, torch.bfloat16)
    assert seen == [expected]
    assert not torch.is_autocast_enabled("cpu")  # left as it was
    with pytest.raises(ValueError, match="autocast_dtype is for a bare causal LM"):
        HFRollout(engine, tok, autocast_dtype=torch.bfloat16)


class _FakeCudaGenerators:
    """Per-device CUDA generator states, standing in for torch.cuda's seeding functions on a
    CPU-only build: which devices were seeded, forked and restored."""

    def __init__(self, monkeypatch) -> None:
        self.states = {0: "state 0", 1: "state 1"}
        self.current = 0
        self.forked: list[list] = []
        cuda = torch.cuda
        monkeypatch.setattr(
            cuda, "get_rng_state", lambda device="cuda": self.states[self._index(device)]
        )
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        monkeypatch.setattr(cuda, "manual_seed", self._seed)
        monkeypatch.setattr(cuda, "manual_seed_all", self._seed_all)
        monkeypatch.setattr(cuda, "device", self._device)
        fork_rng = torch.random.fork_rng

        def recording_fork_rng(devices=None, *args, **kwargs):
            devices = None if devices is None else list(devices)
            self.forked.append(devices)
            return fork_rng(devices, *args, **kwargs)

        monkeypatch.setattr(torch.random, "fork_rng", recording_fork_rng)

    def _index(self, device) -> int:
        device = torch.device(device) if not isinstance(device, int) else device
        return device if isinstance(device, int) else (device.index or self.current)

    def _set(self, state, device="cuda") -> None:
        self.states[self._index(device)] = state

    def _seed(self, seed) -> None:
        self.states[self.current] = f"seeded {seed}"

    def _seed_all(self, seed) -> None:
        self.states = {d: f"seeded {seed}" for d in self.states}

    def _device(self, device):
        import contextlib

        @contextlib.contextmanager
        def current():
            previous, self.current = self.current, self._index(device)
            try:
                yield
            finally:
                self.current = previous

        return current()


def test_seeded_sampling_leaves_the_cuda_generators_unchanged(monkeypatch) -> None:
    """A seeded ``generate`` restores the caller's generators: on a CUDA engine the CPU's and its
    device's (``fork_rng(devices=[device])``), seeding no other device's; on a CPU engine it
    never touches CUDA's (``torch.manual_seed`` would reseed every GPU's generator)."""
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    fake = _FakeCudaGenerators(monkeypatch)
    params = SamplingParams(num_samples=2, max_new_tokens=3, seed=3)
    cpu_state = torch.random.get_rng_state()
    first = HFRollout(model, tok).generate(["1+2="], params)
    assert fake.states == {0: "state 0", 1: "state 1"}
    assert torch.equal(torch.random.get_rng_state(), cpu_state)
    again = HFRollout(model, tok).generate(["1+2="], params)
    assert torch.equal(first.batch["input_ids"], again.batch["input_ids"])

    from microrl.rollout.samplers.hf import seeded

    fake.forked.clear()
    with seeded(5, torch.device("cuda", 1)):
        assert fake.states == {0: "state 0", 1: "seeded 5"}  # the engine's device only
        torch.rand(3)
    assert fake.forked == [[torch.device("cuda", 1)]]
    assert fake.states == {0: "state 0", 1: "state 1"}
    assert torch.equal(torch.random.get_rng_state(), cpu_state)
    with seeded(None, torch.device("cuda", 1)):  # unseeded: nothing forked
        pass
    assert fake.forked == [[torch.device("cuda", 1)]]

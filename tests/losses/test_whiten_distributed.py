"""Batch statistics over data-parallel ranks: ``whiten(group=...)``, the PPO recipe, GRPO groups.

The 2-rank checks follow tests/engine/parallel/test_distributed.py: one launch of this file with
2 gloo ranks runs every check and writes the names of those that passed; the pytest functions
assert on them. Single-process references are computed in the same processes before the process
group exists, so nothing crosses processes but the collectives under test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for the ranks
from distributed_utils import launch, make_batch, single_process, tiny_model  # noqa: E402

from microrl.losses import check_whole_groups, grpo_advantages, whiten  # noqa: E402

# The PPO rollout: 8 rows of uneven lengths, rows 0-3 on rank 0 and 4-7 on rank 1 (contiguous
# halves, as Dist.shard splits), 16 vs 15 loss tokens. The scores differ between the halves
# (mean 0.75 vs 0.25), so whitening each half on its own gives clearly different advantages.
PPO_LENGTHS = (12, 5, 9, 3, 7, 10, 4, 8)
PPO_SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
HALVES = (slice(0, 4), slice(4, 8))
# One SGD step: the update is linear in the gradient, so the only 1-vs-2-rank difference is the
# fp32 summation order of the gradient (and of the log-probs / values feeding the advantages).
# AdamW's first step, g / (|g| + eps), would amplify that rounding for near-zero gradient entries;
# the engine's own DP tests cover AdamW.
PPO_OVERRIDES = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "train.mini_batch_size=8",
    "train.ppo_epochs=1",
    "actor.micro_batch_size=2",
    "critic.micro_batch_size=2",
    "actor.optim.name=sgd",
    "actor.optim.lr=0.5",
    "critic.optim.name=sgd",
    "critic.optim.lr=0.5",
]
ADV_ATOL = 1e-5  # fp32 log-probs and values of FSDP vs unsharded forwards (equal here), then / std
# fp32 gradients summed over ranks in another order (as tests/engine/parallel/test_distributed.py)
PARAM_ATOL = 2e-6
WHITEN_ATOL = 1e-12  # x max(1, |values|): float64 sums, only their order differs (~1e-16)


# ============================================================================ pytest side


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("whiten_dp")
    (tmp / "out").mkdir()
    launch(2, HERE, str(tmp))
    passed = [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1], passed
    return passed[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_whiten_over_two_ranks_equals_whiten_of_the_concatenation(two_rank_checks):
    expected = [
        f"whiten[{case},shift_mean={s}]"
        for case in ("uneven", "offset_mean", "empty_rank", "one_token", "no_token")
        for s in (True, False)
    ]
    assert sorted(c for c in two_rank_checks if c.startswith("whiten[")) == sorted(expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_ppo_on_two_ranks_equals_one_process_on_the_same_rollout(two_rank_checks):
    expected = [
        "ppo_advantages_and_returns",
        "ppo_actor_update",
        "ppo_critic_update",
        "per_rank_whitening_would_differ",
    ]
    assert sorted(c for c in two_rank_checks if c.startswith(("ppo_", "per_rank"))) == sorted(
        expected
    )


def test_whiten_rejects_a_group_that_is_not_a_process_group():
    values, mask = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="ProcessGroup or None"):
        whiten(values, mask, group="world")
    torch.testing.assert_close(whiten(values, mask, group=None), whiten(values, mask))


def test_grpo_groups_are_whole_on_each_rank_and_match_the_global_advantages():
    """The GRPO recipe's layout: each rank samples its own prompts, ``group_size`` rows each, so
    per-rank group statistics are the global ones."""
    import random

    from microrl.configs.examples import GRPOExampleConfig
    from microrl.configs.loader import load_config
    from microrl.configs.run import ModelConfig
    from microrl.engine import ActorEngine
    from microrl.rollout import HFRollout, SamplingParams
    from microrl.run.toy_model import build_model, build_tokenizer
    from microrl.tasks import AdditionTask

    cfg = load_config(
        GRPOExampleConfig,
        None,
        ["rollout.prompts_per_step=4", "rollout.group_size=3", "train.mini_batch_size=4"],
    )
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    actor = ActorEngine(model, cfg.actor)
    task = AdditionTask(max_operand=9, eval_size=8)
    world, per_rank = 2, cfg.rollout.prompts_per_step // 2
    torch.manual_seed(0)
    scores, ids = [], []
    for rank in range(world):  # what each rank of the recipe does in steps 1, 2 and 4
        problems = task.sample(random.Random(rank), per_rank)
        params = SamplingParams(num_samples=cfg.rollout.group_size, max_new_tokens=4)
        rollout = HFRollout(actor, tok).generate([p.prompt for p in problems], params)
        check_whole_groups(rollout.group_ids, cfg.rollout.group_size)
        assert rollout.batch.batch_size[0] == per_rank * cfg.rollout.group_size
        scores.append(torch.rand(len(rollout.texts)).round())  # any scores
        ids.append(rollout.group_ids)
    per_rank_adv = torch.cat([grpo_advantages(s, i)[0] for s, i in zip(scores, ids, strict=True)])
    global_ids = torch.cat([i + rank * per_rank for rank, i in enumerate(ids)])
    global_adv, _ = grpo_advantages(torch.cat(scores), global_ids)
    torch.testing.assert_close(per_rank_adv, global_adv, rtol=0, atol=0)


def test_grpo_group_spanning_ranks_is_an_error():
    # 3 prompts x 2 samples split by rows over 2 ranks: prompt 1's rows land on both.
    ids = torch.arange(3).repeat_interleave(2)
    with pytest.raises(ValueError, match=r"groups must not span ranks.*group 1 has 1"):
        check_whole_groups(ids[:3], 2)
    with pytest.raises(ValueError, match="groups must not span ranks"):
        check_whole_groups(ids[3:], 2)
    check_whole_groups(ids, 2)  # the whole rollout on one rank is fine


# ============================================================================ rank side


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: _full(p.detach()).clone() for n, p in engine.module.named_parameters()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _whiten_cases():
    """``(name, [rank 0 values, rank 1 values], [masks])``: different row counts and widths."""
    gen = torch.Generator().manual_seed(7)

    def rows(b, t, p=0.6, offset=0.0):
        values = torch.randn(b, t, generator=gen, dtype=torch.float64) + offset
        mask = torch.rand(b, t, generator=gen) < p
        return values.masked_fill(~mask, torch.nan), mask  # masked positions may hold NaN

    yield "uneven", *zip(rows(3, 7), rows(5, 4), strict=True)
    yield "offset_mean", *zip(rows(4, 6, offset=1e4), rows(2, 9, offset=1e4), strict=True)
    yield "empty_rank", *zip(rows(3, 5), rows(0, 5), strict=True)
    (v0, m0), (v1, m1) = rows(2, 3, p=0.0), rows(1, 4, p=0.0)
    m0[1, 2] = True  # a single token over both ranks: variance 0
    yield "one_token", [v0.nan_to_num(0.5), v1], [m0, m1]
    yield "no_token", *zip(rows(2, 3, p=0.0), rows(1, 2, p=0.0), strict=True)


def _concat(parts: list[torch.Tensor], fill) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts]
    return torch.cat(padded)


def check_whiten(rank: int, group) -> list[str]:
    passed = []
    for name, values, masks in _whiten_cases():
        for shift_mean in (True, False):
            got = whiten(values[rank], masks[rank], shift_mean=shift_mean, group=group)
            # Reference: one process, the rows of both ranks (padded to one width, unmasked).
            ref = whiten(_concat(values, torch.nan), _concat(masks, False), shift_mean=shift_mean)
            start = values[0].shape[0] if rank else 0
            mine = ref[start : start + values[rank].shape[0], : values[rank].shape[1]]
            # Relative to the input's scale: the float64 sums round at ~1e-16 of |values|.
            scale = max(1.0, values[rank].nan_to_num(0).abs().max().item() if mine.numel() else 0)
            err = _max_diff(got, mine)
            assert err <= WHITEN_ATOL * scale, f"{name}, shift_mean={shift_mean}: {err:.3g}"
            assert got.dtype == values[rank].dtype and not got.isnan().any(), name
            passed.append(f"whiten[{name},shift_mean={shift_mean}]")
    return passed


def _ppo_config():
    """The recipe's own config (configs/ppo_lora.yaml) at test sizes."""
    from microrl.configs.examples import PPOExampleConfig
    from microrl.configs.loader import load_config
    from microrl.run.cli import CONFIG_DIR

    return load_config(PPOExampleConfig, CONFIG_DIR / "ppo_lora.yaml", PPO_OVERRIDES)


def _ppo_setup():
    from microrl.engine import ActorEngine, CriticEngine

    cfg = _ppo_config()
    torch.manual_seed(0)  # the same LoRA initialisation for the reference and rank 0
    actor = ActorEngine(tiny_model(0), cfg.actor)
    critic = CriticEngine(tiny_model(1), cfg.critic)
    full = make_batch(PPO_LENGTHS, seq_len=12, seed=5).select(
        "input_ids", "attention_mask", "loss_mask"
    )
    return cfg, actor, critic, full


def _ppo_run(rows: slice):
    """The recipe's steps 3-5 (ppo_lora.estimate_advantages, ppo_update) on ``rows`` of the
    rollout: one mini-batch of all of them, one epoch."""
    from example_utils import load_recipe

    ppo_lora = load_recipe("ppo_lora")

    cfg, actor, critic, full = _ppo_setup()
    batch, scores = full[rows].clone(), PPO_SCORES[rows]
    actor_before, critic_before = _params(actor), _params(critic)
    ppo_lora.estimate_advantages(actor, critic, batch, scores, cfg)
    ppo_lora.ppo_update(actor, critic, batch, cfg, batch.batch_size[0])
    actor_delta = {n: p - actor_before[n] for n, p in _params(actor).items()}
    critic_delta = {n: p - critic_before[n] for n, p in _params(critic).items()}
    return batch, actor_delta, critic_delta


def check_ppo(rank: int) -> list[str]:
    import torch.distributed as dist

    from microrl.engine.parallel import distributed as D

    ref_batch, ref_actor, ref_critic = single_process(lambda: _ppo_run(slice(0, 8)))
    batch, actor_delta, critic_delta = _ppo_run(HALVES[rank])
    assert D.dp_group() is not None
    passed = []

    mask = ref_batch["loss_mask"]
    for key in ("advantages", "returns"):
        gathered = [torch.empty_like(batch[key]) for _ in range(2)]
        dist.all_gather(gathered, batch[key].contiguous())
        err = _max_diff(torch.cat(gathered)[mask], ref_batch[key][mask])
        assert err <= ADV_ATOL, f"{key}: max |diff| = {err:.3g} > {ADV_ATOL}"
    passed.append("ppo_advantages_and_returns")

    for what, ref, got in (("actor", ref_actor, actor_delta), ("critic", ref_critic, critic_delta)):
        assert ref.keys() == got.keys()
        assert max(d.abs().max().item() for d in ref.values()) > 1e-3, f"{what} did not train"
        for n, d in got.items():
            err = _max_diff(d, ref[n])
            assert err <= PARAM_ATOL, f"{what} {n}: max |diff| = {err:.3g} > {PARAM_ATOL}"
        passed.append(f"ppo_{what}_update")

    # The check is sensitive: whitening each rank's half on its own is far off the reference.
    from microrl.losses import gae_advantages, scores_to_token_rewards

    cfg = _ppo_config()
    mine = batch["loss_mask"]
    raw, _ = gae_advantages(
        scores_to_token_rewards(PPO_SCORES[HALVES[rank]], mine),
        batch["old_values"],
        mine,
        gamma=cfg.gae.gamma,
        lam=cfg.gae.lam,
    )
    local = whiten(raw, mine)
    assert _max_diff(local[mine], ref_batch["advantages"][HALVES[rank]][mine]) > 0.1
    passed.append("per_rank_whitening_would_differ")
    return passed


def main(tmp: str) -> None:
    import torch.distributed as dist

    from microrl.engine.parallel import distributed as D

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    passed = check_ppo(rank)  # references first (before any process group), then 2 ranks
    passed += check_whiten(rank, D.init_distributed())
    dist.barrier()
    (Path(tmp) / "out" / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Sequence parallelism's pure pieces, in one process (the ranks: test_sequence_parallel.py).

The token split and its inverse, the all-to-all layout of Ulysses attention simulated without a
process group (what each rank sends and receives), the replication of key/value heads, the
last-token index of a rank's slice, the gradient scale, and the refusals that need no ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from distributed_utils import actor_config, tiny_model

from microrl.configs.engine import ActorConfig
from microrl.engine.alignment import IGNORE_INDEX
from microrl.engine.parallel.sequence_parallel import (
    SequenceShard,
    check_supported,
    padded_width,
    scale_denominators,
    split_sequence,
)
from microrl.engine.parallel.ulysses_attention import (
    check_heads,
    enable_ulysses_attention,
    join_chunks,
    kv_head_repeats,
    split_chunks,
)
from microrl.losses.aggregation import LossDenominators


def exchange(per_rank: list[torch.Tensor], scatter: int, gather: int) -> list[torch.Tensor]:
    """An all-to-all simulated over a list of ranks' tensors (what ``all_to_all`` does): rank
    ``r`` receives chunk ``r`` of every rank ``p``'s tensor, in rank order."""
    size = len(per_rank)
    sent = [split_chunks(x, size, scatter) for x in per_rank]
    return [
        join_chunks(torch.stack([sent[p][r] for p in range(size)]), gather) for r in range(size)
    ]


@pytest.mark.parametrize("width", [1, 2, 5, 8])
@pytest.mark.parametrize("size", [2, 4])
def test_split_pads_to_a_multiple_and_the_slices_tile_the_row(width, size):
    x = torch.arange(3 * width).view(3, width) + 1
    slices = [split_sequence(x, size, r, IGNORE_INDEX) for r in range(size)]
    local = -(-width // size)
    assert padded_width(width, size) == local * size
    assert all(s.shape == (3, local) for s in slices)  # every rank holds the same token count
    joined = torch.cat(slices, dim=1)
    assert torch.equal(joined[:, :width], x)
    assert (joined[:, width:] == IGNORE_INDEX).all()  # the padding carries the fill value
    # A row shorter than the group (width < size): ranks past it hold padding only.
    if width < size:
        assert (slices[-1] == IGNORE_INDEX).all()


def test_split_keeps_trailing_dimensions():
    x = torch.randn(2, 5, 3)
    slices = [split_sequence(x, 2, r, 0.0) for r in range(2)]
    assert slices[0].shape == (2, 3, 3)
    assert torch.equal(torch.cat(slices, dim=1)[:, :5], x)


@pytest.mark.parametrize("size", [2, 4])
def test_all_to_all_layout_gathers_the_sequence_and_scatters_the_heads(size):
    """q ``[b, H, S/s, D]`` per rank -> ``[b, H/s, S, D]``: rank r's heads r*H/s.. over every
    token; the output exchange brings ``[b, S, H/s, D]`` back to ``[b, S/s, H, D]``."""
    b, heads, seq, d = 2, 8, 12, 3
    full = torch.randn(b, heads, seq, d)
    local = seq // size
    per_rank = [full[:, :, r * local : (r + 1) * local] for r in range(size)]
    gathered = exchange(per_rank, scatter=1, gather=2)
    for r, got in enumerate(gathered):
        block = heads // size
        assert torch.equal(got, full[:, r * block : (r + 1) * block])
    # The attention output per rank ([b, S, H/s, D]) goes back to this rank's tokens, all heads.
    outputs = [g.transpose(1, 2) for g in gathered]
    back = exchange(outputs, scatter=1, gather=2)
    for r, got in enumerate(back):
        assert torch.equal(got, full.transpose(1, 2)[:, r * local : (r + 1) * local])
    # The backward of an exchange is the inverse exchange.
    assert all(torch.equal(a, b) for a, b in zip(exchange(gathered, 2, 1), per_rank, strict=True))


@pytest.mark.parametrize(
    ("kv_heads", "size", "repeats"),
    [(2, 2, 1), (1, 2, 2), (2, 4, 2), (3, 2, 2), (6, 4, 2), (8, 4, 1)],
)
def test_kv_head_repeats(kv_heads, size, repeats):
    assert kv_head_repeats(kv_heads, size) == repeats
    assert (kv_heads * repeats) % size == 0


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(4, 1, 2), (6, 3, 2), (8, 2, 4), (4, 4, 2)]
)
def test_ulysses_heads_with_replicated_kv_equal_full_attention(heads, kv_heads, size):
    """GQA after replication and the exchange: each rank's query heads find their own key/value
    heads locally, and every rank's attention equals the full model's heads."""
    b, seq, d = 1, 8, 4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, seq, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, seq, d, generator=gen) for _ in range(2))
    groups = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    check_heads(heads, kv_heads, size)
    repeats = kv_head_repeats(kv_heads, size)
    local = seq // size

    def shards(t):
        return [t[:, :, r * local : (r + 1) * local] for r in range(size)]

    qs = exchange(shards(q), 1, 2)
    ks = exchange(shards(k.repeat_interleave(repeats, 1)), 1, 2)
    vs = exchange(shards(v.repeat_interleave(repeats, 1)), 1, 2)
    for r in range(size):
        local_groups = qs[r].shape[1] // ks[r].shape[1]
        got = F.scaled_dot_product_attention(
            qs[r],
            ks[r].repeat_interleave(local_groups, 1),
            vs[r].repeat_interleave(local_groups, 1),
            is_causal=True,
        )
        block = heads // size
        torch.testing.assert_close(got, want[:, r * block : (r + 1) * block])


def test_impossible_head_layouts_name_the_key():
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 must divide .*heads \(3"):
        check_heads(3, 1, 2)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4 must divide .*\(6"):
        check_heads(6, 2, 4)


@pytest.mark.parametrize("packed", [False, True])
def test_last_index_of_a_rank_slice(packed):
    """Each sequence's last real token is on exactly one rank, at the localised index."""
    if packed:  # one [1, N] row: lengths 4, 3, 2 -> last tokens at 3, 6, 8 of N = 9
        width, rows, last = 9, 3, torch.tensor([3, 6, 8])
        ids = torch.arange(9).view(1, 9)
    else:  # [3, 5] right-padded rows of lengths 5, 2, 3
        width, rows, last = 5, 3, torch.tensor([4, 5 + 1, 10 + 2])
        ids = torch.arange(15).view(3, 5)
    found = torch.zeros(rows, dtype=torch.long)
    for rank in range(2):
        shard = SequenceShard(None, 2, rank, rows, width, (width,))
        index = shard.localize_last_index(last)
        local = shard.split(ids, -1).flatten()
        picked = torch.where(shard.last_local, local[index], 0)
        found += picked
        assert index.max() < local.numel()
    assert torch.equal(found, ids.flatten()[last])


def test_gradient_scale_counts_every_sp_rank():
    denominators = LossDenominators(torch.tensor(5.0), torch.tensor(2.0), None, 3.0)
    scaled = scale_denominators(denominators, 2)
    assert scaled.grad_scale == 6.0 and scaled.n_tokens is denominators.n_tokens


def test_config_refusals():
    from microrl.engine import ActorEngine

    assert ActorConfig().sequence_parallel_size == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="sequence_parallel_size must be an int"):
            ActorConfig(sequence_parallel_size=bad)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 and tensor_parallel_size=2"):
        ActorConfig(sequence_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 needs 2 processes"):
        ActorEngine(tiny_model(), actor_config(sequence_parallel_size=2))


def test_model_refusals():
    from transformers import GPT2Config, Qwen2Config

    with pytest.raises(ValueError, match="sequence_parallel_size=2: model family 'gpt2'"):
        check_supported(GPT2Config(), 2)
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(Qwen2Config(use_sliding_window=True, sliding_window=4), 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4"):
        check_supported(Qwen2Config(num_attention_heads=4, num_key_value_heads=2), 8)
    check_supported(Qwen2Config(num_attention_heads=4, num_key_value_heads=1), 4)
    model = tiny_model()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="supports the sdpa, eager and flash-attention"):
        enable_ulysses_attention(model, 2)


@pytest.mark.parametrize("base", ["sdpa", "eager"])
def test_without_a_shard_the_wrapper_is_the_base_attention(base):
    """Calls that carry no shard (``generate``, the lm-head probe) run the base implementation
    with transformers' own mask: left-padded rows give the base model's logits."""
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    reference = tiny_model()
    reference.set_attn_implementation(base)
    model = tiny_model()
    model.set_attn_implementation(base)
    assert enable_ulysses_attention(model, 2) == base
    assert model.config._attn_implementation == f"microrl_ulysses_{base}"
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got[mask.bool()], want[mask.bool()])

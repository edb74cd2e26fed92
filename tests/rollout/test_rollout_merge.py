"""The rollout layout's ``truncated`` flag, and merging rollouts (microrl/rollout/layout.py,
microrl/rollout/merge.py): a merged batch is the batch ``build_rollout`` builds from the same
samples, whatever the widths of the batches it came from."""

from __future__ import annotations

import pytest
import torch

from microrl.rollout import Rollout, Samples, build_rollout, merge_rollouts, select_groups

EOS, PAD = 1, 0


def _samples(responses: list[list[int]]) -> Samples:
    """Log-probs that differ from token to token (a function of the token and its column)."""
    logprobs = [[-0.01 * (10 * col + token + 1) for col, token in enumerate(r)] for r in responses]
    return Samples(token_ids=responses, logprobs=logprobs)


def _rollout(prompts, responses, k: int, tag: str) -> Rollout:
    batch = build_rollout(
        prompts, _samples(responses), num_samples=k, eos_token_id=EOS, pad_token_id=PAD
    )
    texts = [f"{tag}{i}" for i in range(len(responses))]
    return Rollout(batch, texts, torch.arange(len(prompts)).repeat_interleave(k))


# Round A: short prompts, long responses (one cut without <eos>); round B: the opposite.
PROMPTS_A = [[2, 3], [4, 5, 6]]
RESPONSES_A = [[7, EOS], [8, 8, 8, 8], [9, 9, EOS, 9], [EOS]]
PROMPTS_B = [[2, 3, 4, 5, 6], [7]]
RESPONSES_B = [[5, EOS], [EOS, 6], [6], [6, EOS]]


def test_truncated_marks_the_responses_without_eos() -> None:
    batch = _rollout(PROMPTS_A, RESPONSES_A, 2, "a").batch
    assert batch["truncated"].dtype == torch.bool
    assert batch["truncated"].tolist() == [False, True, False, False]
    assert batch["loss_mask"].sum(1).tolist() == [2, 4, 3, 1]  # cut after the first <eos>


def _assert_same(actual: Rollout, expected_batch, texts, group_ids) -> None:
    assert set(actual.batch.keys()) == set(expected_batch.keys())
    for key in sorted(expected_batch.keys()):  # a TensorDict iterates over its rows
        got, want = actual.batch[key], expected_batch[key]
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert actual.texts == texts
    assert actual.group_ids.dtype == torch.long and actual.group_ids.tolist() == group_ids


def test_merged_rollouts_are_the_batch_built_from_the_same_samples() -> None:
    a = _rollout(PROMPTS_A, RESPONSES_A, 2, "a")
    b = _rollout(PROMPTS_B, RESPONSES_B, 2, "b")
    assert a.batch["loss_mask"][:, 3].all() and not b.batch["loss_mask"][:, 4].any()  # 3 vs 5
    direct = build_rollout(
        PROMPTS_A + PROMPTS_B,
        _samples(RESPONSES_A + RESPONSES_B),
        num_samples=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    merged = merge_rollouts([a, b], pad_token_id=PAD)
    _assert_same(merged, direct, a.texts + b.texts, [0, 0, 1, 1, 2, 2, 3, 3])
    assert merged.batch["input_ids"].shape == (8, 5 + 4)  # widest prompt + longest response
    alone = merge_rollouts([a], pad_token_id=PAD)  # one rollout: itself
    _assert_same(alone, a.batch, a.texts, a.group_ids.tolist())


def test_selected_groups_merge_to_the_batch_of_their_own_samples() -> None:
    """Keeping some groups of each round narrows the batch to the kept rows' widths."""
    a = _rollout(PROMPTS_A, RESPONSES_A, 2, "a")
    b = _rollout(PROMPTS_B, RESPONSES_B, 2, "b")
    kept_a, kept_b = select_groups(a, [0]), select_groups(b, [1])
    assert kept_a.group_ids.tolist() == [0, 0] and kept_a.texts == ["a0", "a1"]
    assert kept_a.batch["input_ids"].shape[1] == a.batch["input_ids"].shape[1]  # not compacted
    assert kept_b.group_ids.tolist() == [0, 0] and kept_b.texts == ["b2", "b3"]
    direct = build_rollout(
        [PROMPTS_A[0], PROMPTS_B[1]],
        _samples(RESPONSES_A[:2] + RESPONSES_B[2:]),
        num_samples=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    merged = merge_rollouts([kept_a, kept_b], pad_token_id=PAD)
    _assert_same(merged, direct, ["a0", "a1", "b2", "b3"], [0, 0, 1, 1])
    assert merged.batch["input_ids"].shape[1] == 2 + 4  # prompt [2, 3], response [8, 8, 8, 8]


def test_select_keeps_the_row_order_and_renumbers_groups_in_ascending_order() -> None:
    a = _rollout([[2], [3], [4]], [[5, EOS]] * 6, 2, "a")
    picked = select_groups(a, torch.tensor([2, 0]))
    assert picked.texts == ["a0", "a1", "a4", "a5"]
    assert picked.group_ids.tolist() == [0, 0, 1, 1]
    assert torch.equal(picked.batch["input_ids"], a.batch["input_ids"][[0, 1, 4, 5]])


def test_an_observation_inside_a_response_moves_with_it() -> None:
    """Rows whose loss_mask has holes (a multi-turn episode's observations: attended, never
    trained on) merge the same way: the response region starts at the first loss column."""
    a = _rollout(PROMPTS_A, RESPONSES_A, 2, "a")
    b = _rollout(PROMPTS_B, RESPONSES_B, 2, "b")
    direct = build_rollout(
        PROMPTS_A + PROMPTS_B,
        _samples(RESPONSES_A + RESPONSES_B),
        num_samples=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    # Row 1's third response token is an observation (responses start at column 3 in round A,
    # at column 5 in the direct build).
    a.batch["loss_mask"][1, 3 + 2] = False
    direct["loss_mask"][1, 5 + 2] = False
    merged = merge_rollouts([a, b], pad_token_id=PAD)
    _assert_same(merged, direct, a.texts + b.texts, [0, 0, 1, 1, 2, 2, 3, 3])


def test_errors() -> None:
    a = _rollout(PROMPTS_A, RESPONSES_A, 2, "a")
    with pytest.raises(ValueError, match="at least one"):
        merge_rollouts([], pad_token_id=PAD)
    other = _rollout(PROMPTS_B, RESPONSES_B, 2, "b")
    other.batch["extra"] = torch.zeros(4)
    with pytest.raises(ValueError, match="different batch keys"):
        merge_rollouts([a, other], pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"groups \[5\] are not in the rollout"):
        select_groups(a, [0, 5])
    right_padded = _rollout(PROMPTS_A, RESPONSES_A, 2, "a")  # row 0's prompt moved left
    right_padded.batch["attention_mask"][0, :3] = torch.tensor([True, True, False])
    with pytest.raises(ValueError, match="left-padded prompt"):
        merge_rollouts([right_padded], pad_token_id=PAD)


def test_merging_rounds_with_and_without_images_pads_the_image_keys() -> None:
    """Image keys (docs/batch.md#images) are not per token: the rounds' pixel stores are
    concatenated (each entry zero-padded to the widest), each row's ``image_index`` shifted
    past the earlier rounds' entries, the grids zero-padded (a round without images: text
    rows, index -1); never shifted by columns. Selecting groups drops the others' pixels."""
    from microrl.engine.vision import pad_images

    gen = torch.Generator().manual_seed(0)
    a = _rollout(PROMPTS_A, [[7, 8, EOS], [9], [7], [8, 8]], 2, "a")
    b = _rollout([[2]], [[7, EOS], [9, 9]], 2, "b")
    c = _rollout([[3, 4]], [[8], [EOS]], 2, "c")
    images = [(torch.randn(4, 5, generator=gen), torch.tensor([[1, 2, 2]])), None]
    a.batch.update(pad_images([images[i // 2] for i in range(4)]))
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    b.batch.update(pad_images([(torch.randn(12, 5, generator=gen), grid)] * 2))
    merged = merge_rollouts([a, b, c], pad_token_id=PAD).batch
    assert merged["pixel_values"].shape == (2, 12, 5)  # one entry per prompt with images
    assert merged["image_index"].tolist() == [0, 0, -1, -1, 1, 1, -1, -1]
    assert merged["image_grid_thw"].shape == (8, 2, 3)
    assert torch.equal(merged["pixel_values"][:1, :4], a.batch["pixel_values"])
    assert torch.equal(merged["pixel_values"][1:], b.batch["pixel_values"])
    assert merged["pixel_values"][0, 4:].abs().sum() == 0
    assert merged["image_grid_thw"][:2].tolist() == [[[1, 2, 2], [0, 0, 0]]] * 2
    assert merged["image_grid_thw"][4].tolist() == grid.tolist()
    assert merged["image_grid_thw"][6:].abs().sum() == 0
    # Keeping group 1 of the merged rounds (b's prompt) keeps its entry alone, renumbered.
    kept = select_groups(merge_rollouts([a, b, c], pad_token_id=PAD), [2]).batch
    assert kept["pixel_values"].shape == (1, 12, 5) and kept["image_index"].tolist() == [0, 0]
    assert torch.equal(kept["pixel_values"][0], b.batch["pixel_values"][0])

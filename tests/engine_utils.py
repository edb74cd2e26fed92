"""Tiny models, batches and slow obviously-correct references for the engine tests.

Shared: the engine tests (tests/engine/), and the engine-level tests of the fused loss
(tests/kernels/test_fused_loss.py) and of the rollout mismatch (tests/losses/test_mismatch.py).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128
HIDDEN = 32


def tiny_model(arch: str = "qwen2", *, seed: int = 0, dtype=torch.float32, **overrides):
    """A 2-layer, 4-head, hidden-32, vocab-128 causal LM built from a config (no download)."""
    torch.manual_seed(seed)
    kwargs = dict(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    else:
        raise ValueError(arch)
    return model.to(dtype)


def make_batch(
    batch_size: int = 6,
    seq_len: int = 12,
    *,
    padding: str = "mixed",
    seed: int = 0,
    dtype=torch.float32,
    lengths: list[int] | None = None,
) -> TensorDict:
    """Rows of different lengths; response = the last half of each row's real tokens.

    ``padding``: "left", "right", "mixed" (rows alternate left / right / both) or "none".
    Carries the actor and critic loss inputs (old log-probs / values are random; replace them
    with the engine's own for on-policy tests).
    """
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [
            seq_len
            if padding == "none"
            else int(torch.randint(3, seq_len + 1, (1,), generator=gen))
            for _ in range(batch_size)
        ]
    batch_size, seq_len = len(lengths), max(seq_len, max(lengths))
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=gen)
    mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, n in enumerate(lengths):
        pad = seq_len - n
        kind = padding if padding != "mixed" else ("left", "right", "both")[b % 3]
        start = {"left": pad, "right": 0, "both": pad // 2, "none": 0}[kind]
        mask[b, start : start + n] = True
        prompt = max(1, n // 2)
        loss_mask[b, start + prompt : start + n] = True
    return TensorDict(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(batch_size, seq_len, generator=gen, dtype=dtype),
        old_logprobs=-torch.rand(batch_size, seq_len, generator=gen, dtype=dtype) * 3,
        old_values=torch.randn(batch_size, seq_len, generator=gen, dtype=dtype),
        returns=torch.randn(batch_size, seq_len, generator=gen, dtype=dtype),
        batch_size=[batch_size],
    )


def pair_batch(n_pairs: int = 4, seq_len: int = 12, *, padding: str = "mixed", seed: int = 0):
    """``2 * n_pairs`` rows of random lengths, the pairs shuffled over the batch (a pair's rows
    are rarely adjacent; the chosen one is sometimes first, sometimes second)."""
    batch = make_batch(2 * n_pairs, seq_len, padding=padding, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(2 * n_pairs, generator=gen)
    group = torch.arange(n_pairs).repeat_interleave(2)[perm]
    chosen = torch.tensor([True, False] * n_pairs)[perm]
    return TensorDict(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        group=group,
        chosen=chosen,
        batch_size=[2 * n_pairs],
    )


def repad(batch: TensorDict, padding: str) -> TensorDict:
    """The same rows with their real spans moved to another padding side."""
    out = batch.clone()
    mask = batch["attention_mask"]
    seq_len = mask.shape[1]
    for key in list(out.keys()):
        if key == "attention_mask" or out[key].shape[1:] != mask.shape[1:]:
            continue
        out[key].zero_()
    out["attention_mask"].zero_()
    for b in range(mask.shape[0]):
        cols = mask[b].nonzero().squeeze(1)
        n = len(cols)
        start = {"left": seq_len - n, "right": 0, "both": (seq_len - n) // 2}[padding]
        for key in list(batch.keys()):
            if key == "attention_mask":
                continue
            out[key][b, start : start + n] = batch[key][b, cols]
        out["attention_mask"][b, start : start + n] = True
    return out


@torch.no_grad()
def reference_logprobs(
    model, batch: TensorDict, temperature: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row without padding: ``log_softmax(model(ids).logits / T)`` at the next token.

    ``temperature``: a float, a ``[B]`` tensor (per row) or ``[B, T]`` (token-aligned: the one
    token ``t`` is scored with). Returns token-aligned ``[B, T]`` log-probs and entropies (0 where
    there is no prediction).
    """
    was_training = model.training
    model.eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logprobs = torch.zeros(ids.shape, dtype=torch.float64)
    entropy = torch.zeros(ids.shape, dtype=torch.float64)
    for b in range(ids.shape[0]):
        cols = mask[b].nonzero().squeeze(1)
        row = ids[b, cols].unsqueeze(0)
        temp = torch.as_tensor(temperature, dtype=torch.float64)
        if temp.dim() == 1:
            temp = temp[b]
        elif temp.dim() == 2:  # position j predicts token cols[j + 1]
            temp = torch.cat([temp[b, cols[1:]], torch.ones(1, dtype=temp.dtype)]).unsqueeze(-1)
        logits = model(input_ids=row, use_cache=False).logits[0].double() / temp
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp[:-1].gather(-1, row[0, 1:, None]).squeeze(-1)
        logprobs[b, cols[1:]] = picked
        entropy[b, cols[1:]] = -(logp.exp() * logp).sum(-1)[:-1]
    model.train(was_training)
    return logprobs, entropy


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameter gradients (zeros where None), cloned."""
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def assert_close_dicts(actual: dict, expected: dict, *, rtol: float, atol: float) -> None:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for key in expected:
        a, e = actual[key], expected[key]
        if isinstance(e, torch.Tensor):
            worst = (a - e).abs().max().item() if a.numel() else 0.0
            assert torch.allclose(a, e, rtol=rtol, atol=atol), f"{key}: worst abs diff {worst}"
        else:
            assert abs(a - e) <= atol + rtol * abs(e), f"{key}: {a} vs {e}"

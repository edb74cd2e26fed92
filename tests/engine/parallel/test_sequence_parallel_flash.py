"""Ulysses sequence parallelism on flash-attention's varlen path (engine/parallel/ulysses_attention.py).

flash_attn needs a CUDA GPU. On the CPU, :func:`install_flash_stand_in` replaces the kernel only:
transformers' own flash-attention function runs (``flash_attention_forward`` and its varlen,
unpad and position-ids paths), and the kernels it imports (``_lazy_imports``) are plain-torch
functions with flash_attn's contract: ``flash_attn_varlen_func`` takes the flattened
``[total, heads, d]`` tokens with int32 ``cu_seqlens`` and attends causally within each sequence
(SDPA per sequence, query head ``h`` on key/value head ``h // (H / Hkv)`` as flash pairs them),
after checking its arguments; every call is recorded (:data:`CALLS`). The one-process references
run on the same stand-in, through transformers' non-SP flash paths (boundaries from the packed
position ids, padded rows unpadded by the attention mask).

On 2 gloo ranks (``sp_flash``, with the helpers and tolerances of test_sequence_parallel.py in
``sequence_parallel_utils``): a packed actor with LoRA and checkpointing (a sequence across the
ranks' slices, uneven lengths, a one-token micro-batch shorter than the group) and padded rows of
a Llama with one key/value head (replicated to two), each exact against one process; every
kernel call got the shard's ``cu_seqlens`` and longest length; and one sequence for the whole row
(boundaries ignored) fails the same comparison. With CUDA and flash_attn
(benchmarks/gpu_check.sh), the real kernel through the wrapper on one rank
(:func:`test_real_flash_attention_2_on_cuda`).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import (
    VOCAB,
    actor_config,
    make_batch,
    run_scenario,
    scenario_main,
    single_process,
    tiny_model,
)
from sequence_parallel_utils import (
    SP_LENGTHS,
    build_engine,
    compare_steps,
    llama_mqa,
    run_steps,
    write_json,
)

from microrl.engine.parallel import ulysses_attention as U
from microrl.engine.parallel.sequence_parallel import SequenceShard

HERE = Path(__file__).resolve()
FLASH = "flash_attention_2"
#: Every call of the stand-in varlen kernel: (cu_seqlens, max_seqlen, query heads, kv heads).
CALLS: list[tuple[tuple[int, ...], int, int, int]] = []


# ============================================================================ the stand-in


def _attend(q, k, v, starts: list[int], scale: float | None, causal: bool) -> torch.Tensor:
    """``[total, H, d]`` attention within each ``starts[i]:starts[i + 1]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    assert heads % kv_heads == 0, (heads, kv_heads)
    out = torch.empty_like(q)
    for start, end in pairwise(starts):
        if end > start:
            qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
            ki, vi = (t.repeat_interleave(heads // kv_heads, 0) for t in (ki, vi))
            att = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale)
            out[start:end] = att.transpose(0, 1)
    return out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash_attn's ``flash_attn_varlen_func`` in plain torch, checking what it is given."""
    assert q.dim() == k.dim() == v.dim() == 3, (q.shape, k.shape)
    for cu in (cu_seqlens_q, cu_seqlens_k):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == q.device, cu
    assert torch.equal(cu_seqlens_q, cu_seqlens_k)  # self-attention
    starts = cu_seqlens_q.tolist()
    assert starts[0] == 0 and starts[-1] == q.shape[0] == k.shape[0], (starts, q.shape)
    assert all(a <= b for a, b in pairwise(starts)), starts
    longest = max(b - a for a, b in pairwise(starts))
    assert int(max_seqlen_q) == int(max_seqlen_k) == longest, (max_seqlen_q, max_seqlen_k, starts)
    assert causal and dropout_p == 0.0 and tuple(window_size) == (-1, -1), (causal, window_size)
    assert not softcap and alibi_slopes is None and block_table is None
    CALLS.append((tuple(starts), longest, q.shape[1], k.shape[1]))
    return _attend(q, k, v, starts, softmax_scale, causal)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    """flash_attn's ``flash_attn_func`` (``[b, n, heads, d]``, no padding) in plain torch."""
    assert dropout_p == 0.0
    b, n = q.shape[:2]
    flat = [t.reshape(b * n, *t.shape[2:]) for t in (q, k, v)]
    out = _attend(*flat, list(range(0, b * n + 1, n)), softmax_scale, causal)
    return out.view(*q.shape)


def _stand_in_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
    """transformers' ``_lazy_imports``: the stand-in kernels; the base's name, never the
    wrapper's, must ask for them."""
    import transformers.modeling_flash_attention_utils as fa

    assert implementation == FLASH, implementation
    return flash_attn_func, flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input


_FLASH_CACHE = (
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
)


def install_flash_stand_in(monkeypatch=None) -> None:
    """transformers' flash-attention imports the stand-in kernels (until ``monkeypatch`` undoes
    it; for good in a rank process)."""
    import transformers.modeling_flash_attention_utils as fa

    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    # What lazy_import_flash_attention caches, restored with the rest (a real kernel loaded
    # before stays the one loaded after).
    for cached in _FLASH_CACHE:
        setattr_(fa, cached, getattr(fa, cached))
    setattr_(fa, "_lazy_imports", _stand_in_imports)
    setattr_(fa, "_loaded_implementation", None)  # loaded again, from the stand-in


def flash_model(build=tiny_model):
    """``build()`` on flash_attention_2. Set on the config directly: ``set_attn_implementation``
    would check for flash_attn and a CUDA device (the stand-in needs neither)."""
    model = build()
    model.config._attn_implementation = FLASH
    return model


@pytest.fixture
def stand_in(monkeypatch):
    install_flash_stand_in(monkeypatch)
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def _packed(lengths, seed: int = 0):
    """A packed ``[1, N]`` row of ``lengths``: token ids and restarting position ids."""
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, positions


# ============================================================================ one process


def test_stand_in_gives_a_packed_row_each_sequence_own_attention(stand_in):
    """The stand-in through transformers' flash path: a packed row (boundaries from the
    position ids) gets each sequence's own SDPA logits, with one varlen call per layer."""
    lengths = (5, 1, 7)
    ids, positions = _packed(lengths)
    sdpa = tiny_model()
    with torch.no_grad():
        got = flash_model()(input_ids=ids, position_ids=positions).logits
        want = torch.cat([sdpa(input_ids=part).logits for part in ids.split(lengths, dim=1)], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert stand_in == [((0, 5, 6, 13), 7, 4, 2)] * 2  # 2 layers, 4 query and 2 kv heads


def test_wrapper_names_and_flash_bases(monkeypatch):
    """A flash base's wrapper name has no "flash" (transformers would import a kernel by that
    name) and no "/" (a hub kernel to download); hub kernels that transformers registers with its
    flash function are flash bases too."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward

    assert U.wrapper_name("sdpa") == "microrl_ulysses_sdpa"
    assert U.wrapper_name(FLASH) == "microrl_ulysses_fa_attention_2"
    assert all(U.is_flash(b) for b in U.BASES[2:]) and not U.is_flash("sdpa")
    assert not U.is_flash("flex_attention") and not U.is_flash(None)
    kernel = "kernels-community/flash-attn2"  # as load_and_register_attn_kernel registers it
    monkeypatch.setitem(AttentionInterface._global_mapping, kernel, flash_attention_forward)
    assert U.is_flash(kernel)
    assert U.wrapper_name(kernel) == "microrl_ulysses_kernels-community--fa-attn2"
    model = flash_model()
    assert U.enable_ulysses_attention(model, 2) == FLASH
    name = model.config._attn_implementation
    assert name == "microrl_ulysses_fa_attention_2" and U.base_implementation(name) == FLASH
    assert U.enable_ulysses_attention(model, 2) == FLASH  # again: unchanged
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="supports the sdpa, eager and flash-attention"):
        U.enable_ulysses_attention(model, 2)


def test_flash_varlen_kwargs():
    packed = U.flash_varlen_kwargs((5, 4, 1), 1, "cpu")  # two sequences and a padding tail
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 9, 10]
    assert packed["cu_seq_lens_q"].dtype == torch.int32
    assert packed["cu_seq_lens_k"] is packed["cu_seq_lens_q"]
    assert packed["max_length_q"] == packed["max_length_k"] == 5
    rows = U.flash_varlen_kwargs((6,), 3, "cpu")  # 3 padded rows of width 6
    assert rows["cu_seq_lens_q"].tolist() == [0, 6, 12, 18] and rows["max_length_q"] == 6


def test_without_a_shard_the_wrapper_is_flash_attention(stand_in):
    """``generate``, the lm-head probe: transformers' flash path with its own (2-D) mask."""
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    reference, model = flash_model(), flash_model()
    U.enable_ulysses_attention(model, 2)
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).logits
        calls = len(stand_in)
        got = model(input_ids=ids, attention_mask=mask).logits
    assert calls == 2 and stand_in[2:] == stand_in[:2]  # unpadded by the mask: lengths 7, 4
    assert stand_in[0][0] == (0, 7, 11)
    assert torch.equal(got[mask.bool()], want[mask.bool()])


# ============================================================================ 2 gloo ranks


@pytest.mark.distributed
@pytest.mark.slow
def test_sp2_flash_varlen_equals_one_process(tmp_path):
    passed = run_scenario(tmp_path, 2, HERE, "sp_flash", timeout=300)
    assert passed == [
        "actor[flash,lora,packed,grad_ckpt]",
        "actor[flash,llama,mqa,padded]",
        "boundaries_matter",
    ]


def _flash_cases():
    batch = lambda: make_batch(SP_LENGTHS)  # noqa: E731
    packed = actor_config(lora=4, pack_sequences=True, gradient_checkpointing=True)
    yield "actor[flash,lora,packed,grad_ckpt]", flash_model, packed, batch
    mqa = lambda: flash_model(llama_mqa)  # noqa: E731
    yield "actor[flash,llama,mqa,padded]", mqa, actor_config(), batch


def _check_calls(name: str, shards: list[SequenceShard], packed: bool) -> None:
    """Every kernel call got one micro-batch's ``cu_seqlens`` (its packed sequences and padding
    tail, or its padded rows), on this rank's 2 of the 4 query heads and 1 key/value head."""
    expected = set()
    for shard in shards:
        lengths = shard.attention_lengths * (1 if packed else shard.rows)  # per row: the width
        expected.add(((0, *_cumsum(lengths)), max(lengths), 2, 1))
    assert CALLS and set(CALLS) == expected, (name, set(CALLS) ^ expected)
    assert all(shard.attention_calls and shard.flash_varlen for shard in shards)
    # What the cases are for: a micro-batch shorter than the group (one rank holds padding
    # only) and, packed, a sequence across the two ranks' slices.
    assert any(shard.width < shard.size for shard in shards), name
    if packed:
        crossing = [
            s
            for s in shards
            if any(a < s.local < b for a, b in pairwise((0, *_cumsum(s.attention_lengths))))
        ]
        assert crossing, f"{name}: no sequence spans the slices"


def _cumsum(lengths):
    total, out = 0, []
    for n in lengths:
        total += n
        out.append(total)
    return out


def scenario_sp_flash(rank: int, tmp: Path) -> list[str]:
    from microrl.engine.parallel import sequence_parallel

    install_flash_stand_in()
    cases = list(_flash_cases())

    def references():
        refs = {}
        for name, build, config, data in cases:
            CALLS.clear()
            refs[name] = run_steps(build_engine("actor", build, config), data())
            # One process on the stand-in too: packed rows split by their position ids.
            assert CALLS, name
            if config.pack_sequences:
                assert any(len(call[0]) > 2 for call in CALLS), name
        return refs

    refs = single_process(references)
    shards: list[SequenceShard] = []
    real_shard = sequence_parallel.shard_model_inputs

    def spy(*args, **kwargs):
        out = real_shard(*args, **kwargs)
        shards.append(out[2])
        return out

    sequence_parallel.shard_model_inputs = spy
    passed, worst = [], {}
    try:
        for name, build, config, data in cases:
            CALLS.clear()
            shards.clear()
            engine = build_engine("actor", build, config, sp=2)
            compare_steps(name, refs[name], run_steps(engine, data()), worst)
            _check_calls(name, shards, config.pack_sequences)
            passed.append(name)
    finally:
        sequence_parallel.shard_model_inputs = real_shard

    # ---- the comparison sees the boundaries: one sequence for the whole row fails it
    name, build, config, data = cases[0]
    real_kwargs = U.flash_varlen_kwargs
    U.flash_varlen_kwargs = lambda lengths, rows, device: real_kwargs((sum(lengths),), rows, device)
    try:
        engine = build_engine("actor", build, config, sp=2)
        with pytest.raises(AssertionError, match=rf"{re.escape(name)} step 0"):
            compare_steps(name, refs[name][:1], run_steps(engine, data(), steps=1), {})
    finally:
        U.flash_varlen_kwargs = real_kwargs
    passed.append("boundaries_matter")
    if rank == 0:
        write_json(tmp, "sp_flash_worst.json", worst)
    return passed


# ============================================================================ the real kernel


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="the real flash_attention_2 needs a CUDA device and flash_attn",
)
def test_real_flash_attention_2_on_cuda():
    """The real kernel through the wrapper, on one rank (the all-to-alls are copies; two ranks
    need two GPUs, and run on the stand-in above): a packed row's attention equals each
    sequence's own (SDPA in float32 on the same bf16 inputs), forward and backward, where one
    sequence for the whole row does not; and a packed model forward through the wrapper gives
    the logits of transformers' own flash path on that row (boundaries from the position ids)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        device, dtype = torch.device("cuda"), torch.bfloat16
        lengths = (9, 14, 1, 6)
        width = sum(lengths)

        def shard(attention_lengths):
            return SequenceShard(None, 1, 0, len(lengths), width, attention_lengths)

        model = tiny_model(hidden=64).to(device, dtype)  # 4 heads of 16, 2 key/value heads
        reference = tiny_model(hidden=64).to(device, dtype)
        for m in (model, reference):
            m.set_attn_implementation(FLASH)  # the real checks: flash_attn on a CUDA device
        assert U.enable_ulysses_attention(model, 1) == FLASH
        attention = model.model.layers[0].self_attn
        wrapper = U.ulysses_attention

        # ---- the attention itself, forward and backward
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, 4, width, 16, generator=gen, device=device, dtype=dtype)
        k, v = (
            torch.randn(1, 2, width, 16, generator=gen, device=device, dtype=dtype) for _ in "kv"
        )
        grad_out = torch.randn(1, width, 4, 16, generator=gen, device=device, dtype=dtype)

        def run(fn):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(grad_out.to(out.dtype))
            return out.float(), [t.grad.float() for t in leaves]

        def per_sequence(q, k, v):
            flat = [t[0].transpose(0, 1).float() for t in (q, k, v)]  # [total, heads, d]
            starts = [0, *_cumsum(lengths)]
            return _attend(*flat, starts, attention.scaling, True).unsqueeze(0)

        def through(attention_lengths):
            def fn(q, k, v):
                kwargs = {U.SHARD_KWARG: shard(attention_lengths), "scaling": attention.scaling}
                return wrapper(attention, q, k, v, None, base=FLASH, dropout=0.0, **kwargs)[0]

            return fn

        want, want_grads = run(per_sequence)
        got, got_grads = run(through(lengths))
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)
        ignored, _ = run(through((width,)))
        assert (ignored - want).abs().max() > 0.1, "one sequence for the row changed nothing"

        # ---- a packed forward: the wrapper's varlen call, transformers' own on the row
        ids = torch.randint(0, VOCAB, (1, width), device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
        placeholder = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)
        with torch.no_grad():
            want = reference(input_ids=ids, position_ids=positions).logits.float()
            got = model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=placeholder,
                **{U.SHARD_KWARG: shard(lengths)},
            ).logits.float()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    finally:
        dist.destroy_process_group()


def main(scenario: str, tmp: str) -> None:
    scenario_main(globals(), scenario, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])

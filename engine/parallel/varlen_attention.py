"""Variable-length attention for packed rows on the SDPA / eager kernels.

transformers' block-diagonal ``[N, N]`` mask for a packed row costs ``N^2`` instead of
``sum(n_i^2)``, and a sequence's log-probs change in the last bits with its companions.
``microrl_varlen_<base>`` (a transformers ``AttentionInterface``) runs ``<base>`` once per
sequence when the forward carries ``packed_seq_lens``, else exactly ``<base>``. In ``parallel/``
because the Ulysses wrapper runs it too.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from torch import nn

__all__ = ["PACKED_LENGTHS_KWARG", "VARLEN_PREFIX", "enable_varlen_attention", "varlen_attention"]

#: The model keyword argument that carries a packed row's sequence lengths to attention.
PACKED_LENGTHS_KWARG = "packed_seq_lens"
#: Prefix of the registered implementations (``microrl_varlen_sdpa``, ``microrl_varlen_eager``).
VARLEN_PREFIX = "microrl_varlen_"
_BASES = ("sdpa", "eager")


def enable_varlen_attention(model: nn.Module) -> bool:
    """Switch ``model`` to the varlen variant of its SDPA/eager attention; False if not applicable
    (flash-attention has its own varlen path, other implementations are left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = getattr(model, "config", None)
    base = getattr(config, "_attn_implementation", None)
    if base not in _BASES:
        return base is not None and base.startswith(VARLEN_PREFIX)
    if base == "eager" and not any(_model_eager_attention(m) for m in model.modules()):
        return False  # a model without the usual per-file eager function: leave it alone
    name = f"{VARLEN_PREFIX}{base}"
    AttentionInterface.register(name, partial(varlen_attention, base=base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    return True


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    base: str,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``base`` attention once per sequence of ``kwargs[PACKED_LENGTHS_KWARG]``, or once
    over the rows without it: ``query`` ``[1, heads, N, d]`` (key/value may have fewer heads)
    -> ``[1, N, heads, d]``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is not in the registry: each modeling file has its own eager_attention_forward.
    attend = _model_eager_attention(module) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
    lengths = kwargs.pop(PACKED_LENGTHS_KWARG, None)
    if lengths is None:
        return attend(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    outputs, start = [], 0
    for length in lengths:
        end = start + length
        mask = None
        # SDPA infers a causal mask; eager, or a window shorter than the sequence, needs one.
        if base == "eager" or (window is not None and length > window):
            mask = _causal_mask(length, window, query.dtype, query.device)
        out, _ = attend(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            mask,
            **kwargs,
        )
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=1), None


def _model_eager_attention(module: nn.Module):
    """The ``eager_attention_forward`` of the modeling file that defines ``module``, or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _causal_mask(
    length: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive ``[1, 1, n, n]`` mask: 0 where query ``i`` sees key ``j`` (``i - window < j <=
    i``)."""
    rows = torch.arange(length, device=device).unsqueeze(1)
    cols = torch.arange(length, device=device).unsqueeze(0)
    allowed = cols <= rows
    if window is not None:
        allowed &= cols > rows - window
    # Built in ``dtype``: float64's lowest value does not fit the default float32.
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).view(1, 1, length, length)

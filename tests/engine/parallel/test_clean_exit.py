"""A 2-rank script that lets the engine start the process group and never ends it exits cleanly.

Seen before ``shutdown`` kept its exit barrier: about 1 launch in 10 ended with rank 0 killed by
SIGABRT ("terminate called without an active exception"). A gloo worker thread dropped the last
reference to that barrier after the interpreter began finalizing; freeing the finished all-reduce
it had waited on released tensors whose Python objects need the GIL, and Python ends such a thread
(``pthread_exit``) inside a ``noexcept`` destructor. Ten runs, every rank exit 0.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from distributed_utils import launch

SCRIPT = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from microrl.configs import ActorConfig
    from microrl.engine import ActorEngine

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )
    engine = ActorEngine(LlamaForCausalLM(config), ActorConfig(micro_batch_size=2))
    ids = torch.randint(0, 64, (2, 6))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.arange(6).expand(2, 6) > 0,
        "old_logprobs": torch.zeros(2, 6),
        "advantages": torch.ones(2, 6),
    }
    engine.forward_backward_batch(batch)
    print("done", flush=True)
    """
)

RUNS = 10


@pytest.mark.distributed
def test_an_engine_started_group_exits_cleanly_every_time(tmp_path: Path) -> None:
    script = tmp_path / "no_teardown.py"
    script.write_text(SCRIPT)
    for run in range(RUNS):
        output = launch(2, script, timeout=120)  # fails on any non-zero exit code
        assert output.count("done") == 2, f"run {run}:\n{output}"
        assert "terminate called" not in output, f"run {run}:\n{output}"

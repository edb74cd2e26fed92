"""vLLM's engine arguments, without starting vLLM: the dtype ``auto`` resolves to, the
``rollout.vllm.engine_kwargs`` keys microrl refuses, their ``vllm serve`` flags, the CPU
scheduler setting on the servers' command line, and the config keys from YAML and the command
line."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from microrl.configs.loader import describe_config, load_config
from microrl.configs.rollout import VLLMConfig
from microrl.configs.run import RolloutConfig
from microrl.engine.rollout.vllm_args import (
    CPU_OWNED,
    OWNED,
    SERVER_OWNED,
    cli_flags,
    resolve_dtype,
    user_engine_args,
)
from microrl.remote.trainer.vllm_launch import serve_command


def _engine(device: str, dtype: str = "auto"):
    return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(dtype=dtype))


def test_auto_is_the_trainers_compute_dtype():
    fp32, bf16 = nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16)
    assert resolve_dtype("auto", _engine("cuda:3"), fp32) == "bfloat16"  # bf16 autocast
    assert resolve_dtype("auto", _engine("cuda", "bfloat16"), fp32) == "bfloat16"
    assert resolve_dtype("auto", _engine("cuda", "float32"), fp32) == "float32"
    assert resolve_dtype("auto", _engine("cpu"), fp32) == "float32"  # exact on a CPU
    assert resolve_dtype("auto", _engine("cpu"), bf16) == "bfloat16"  # a 16-bit LoRA base
    assert resolve_dtype("float16", _engine("cuda"), fp32) == "float16"


def test_owned_and_duplicate_keys_are_refused_by_name():
    owned = {**OWNED, **SERVER_OWNED, **CPU_OWNED}
    assert user_engine_args({"max-num-seqs": 8, "swap_space": 1}, owned=owned) == {
        "max_num_seqs": 8,
        "swap_space": 1,
    }
    with pytest.raises(ValueError, match=r"engine_kwargs\.port cannot be set: microrl owns it"):
        user_engine_args({"port": 1}, owned=owned)
    with pytest.raises(ValueError, match=r"engine_kwargs\.seed cannot be set: use rollout\.vllm"):
        user_engine_args({"seed": 1}, owned=owned)
    with pytest.raises(ValueError, match="long_prefill_token_threshold cannot be set"):
        user_engine_args({"long-prefill-token-threshold": 64}, owned=owned)
    with pytest.raises(ValueError, match=r"engine_kwargs\.max_num_seq is not an argument"):
        user_engine_args({"max_num_seq": 8}, owned={}, valid={"max_num_seqs"})


def test_engine_kwargs_as_serve_flags():
    flags = cli_flags(
        {
            "max_num_seqs": 64,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "compilation_config": {"mode": 0},
            "cuda_graph_sizes": [1, 2],
            "served_model_name": None,
        }
    )
    assert flags == [
        "--max-num-seqs", "64", "--no-enable-prefix-caching", "--enforce-eager",
        "--compilation-config", '{"mode": 0}', "--cuda-graph-sizes", "1", "2",
    ]  # fmt: skip


def test_the_servers_command_line():
    """On a CPU no chunked prefill: a prompt split across steps crashes vLLM's CPU sampler on a
    seeded request; the user's arguments come last (argparse keeps the last of a flag)."""
    on_cpu = serve_command("/m", port=1, cpu=True, engine_args={"max_num_seqs": 8})
    assert "--no-enable-chunked-prefill" in on_cpu
    assert on_cpu[-2:] == ["--max-num-seqs", "8"]
    gpu = serve_command("/m", port=1, engine_args={"distributed_executor_backend": "mp"})
    assert "--no-enable-chunked-prefill" not in gpu and gpu[-1] == "mp"


@dataclass
class _Recipe:
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


def test_engine_kwargs_and_sleep_level_from_yaml_and_the_command_line(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "rollout:\n  backend: vllm\n  vllm:\n    engine_kwargs:\n      max_num_seqs: 8\n"
        "      compilation_config: {mode: 0}\n"
    )
    cfg = load_config(
        _Recipe,
        yaml,
        ["rollout.vllm.engine_kwargs.max_num_seqs=64", "rollout.vllm.engine_kwargs.swap_space=2",
         "rollout.vllm.sleep_level=1"],
    )  # fmt: skip
    assert cfg.rollout.vllm.engine_kwargs == {
        "max_num_seqs": 64,
        "compilation_config": {"mode": 0},
        "swap_space": 2,
    }
    assert cfg.rollout.vllm.sleep_level == 1
    rows = {key: value for key, value, _ in describe_config(cfg)}
    assert "max_num_seqs: 64" in rows["rollout.vllm.engine_kwargs"]
    assert VLLMConfig().engine_kwargs == {} and VLLMConfig().engine_kwargs is not (
        VLLMConfig().engine_kwargs
    )  # a fresh dict per config
    with pytest.raises(ValueError, match=r"'rollout\.vllm\.engine_kwargs'.*a mapping"):
        load_config(_Recipe, None, ["rollout.vllm.engine_kwargs=3"])
    with pytest.raises(ValueError, match=r"rollout\.vllm\.sleep_level.*0, 1 or 2"):
        load_config(_Recipe, None, ["rollout.vllm.sleep_level=3"])

"""vLLM's options, without starting vLLM: the dtype ``auto`` resolves to, the
``rollout.vllm.engine_kwargs`` keys microrl refuses, their ``vllm serve`` flags, the CPU
scheduler setting on the servers' command line, and the config keys from YAML and the command
line.

Both vLLM integrations, the in-process engine (``vllm.LLM`` a :class:`~vllm_utils.FakeLLM`) and
the local servers (servers that record their options and answer every request with ``<eos>``),
take each shared rule from :mod:`microrl.rollout.samplers.vllm_options`: a rule replaced there
changes what both give vLLM.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from torch import nn
from vllm_utils import FakeLLM, use_fake_llm

from microrl.configs.loader import describe_config, load_config
from microrl.configs.rollout import VLLMConfig
from microrl.configs.run import RolloutConfig
from microrl.rollout import SamplingParams
from microrl.rollout.base import SEED_RANGE, draw_seed
from microrl.rollout.samplers import vllm_options
from microrl.rollout.samplers.vllm_launch import serve_command
from microrl.rollout.samplers.vllm_options import (
    CPU_OWNED,
    OWNED,
    SERVER_OWNED,
    cli_flags,
    resolve_dtype,
    user_engine_args,
)


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


# ----------------------------------------------------------------- both integrations
class RecordingServer:
    """``LocalVLLMServer`` that records its options and answers every request with ``<eos>``;
    nothing runs."""

    started: ClassVar[list[dict]] = []

    def __init__(self, model_dir: str, **options) -> None:
        RecordingServer.started.append(options)
        self.name, self.url, self.bodies = "recording server", "http://127.0.0.1:1", []
        self.client = SimpleNamespace(url=self.url, post=self._post)

    def _post(self, route: str, body=None, **query):
        assert route == "inference/v1/generate", route
        self.bodies.append(body)
        sampling = body["sampling_params"]
        eos = {"token_ids": sampling["stop_token_ids"], "logprobs": {"content": [{"logprob": -1}]}}
        return {"choices": [{"index": i, **eos} for i in range(sampling["n"])]}

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def lora_engine(tokenizer):
    from microrl.configs import ActorConfig, LoraConfig
    from microrl.configs.run import ModelConfig
    from microrl.engine import ActorEngine
    from microrl.run.toy_model import build_model

    torch.manual_seed(0)
    # head_dim 32: a head size vLLM's CPU attention supports.
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=0)
    return ActorEngine(build_model(cfg, tokenizer), ActorConfig(lora=LoraConfig(rank=4)))


@pytest.fixture
def start_both(monkeypatch, tokenizer, lora_engine):
    """``config -> (in-process rollout, server rollout)`` for the same LoRA engine; the server
    rollout's first sync is skipped (no weights move) and its export is not written."""
    from microrl.rollout.samplers import vllm_launch, vllm_servers
    from microrl.rollout.samplers.vllm import VLLMRollout

    use_fake_llm(monkeypatch)
    RecordingServer.started = []
    monkeypatch.setattr(vllm_launch, "LocalVLLMServer", RecordingServer)
    done: Future = Future()
    done.set_result(None)
    monkeypatch.setattr(vllm_servers.VLLMServerRollout, "_submit_sync", lambda *a, **k: done)
    opened = []

    def start(config: VLLMConfig | None = None, workdir=None):
        config = config or VLLMConfig()
        opened.append(VLLMRollout(lora_engine, tokenizer, config, workdir=workdir))
        with monkeypatch.context() as patch:  # the in-process rollout's export only
            patch.setattr(vllm_options, "export_merged_model", lambda *args, **kwargs: None)
            server = vllm_servers.VLLMServerRollout(lora_engine, tokenizer, config, workdir=workdir)
        opened.append(server)
        return opened[-2], server

    yield start
    for rollout in opened:
        rollout.close()


def _started(start_both) -> tuple[dict, dict]:
    """What the in-process engine and the one local server were started with."""
    start_both()
    return FakeLLM.last.kwargs, RecordingServer.started[-1]


# rule: what the replaced rule returns; the in-process engine's and the server's value of it
ENGINE_RULES = {
    "resolve_dtype": ("float16", lambda llm: llm["dtype"], lambda server: server["dtype"]),
    "kv_cache_mb": (
        7,
        lambda llm: llm["kv_cache_memory_bytes"] / 2**20,
        lambda server: server["kv_cache_mb"],
    ),
    "enforce_eager": (False, lambda llm: llm["enforce_eager"], lambda s: s["enforce_eager"]),
    "max_lora_rank": (64, lambda llm: llm["max_lora_rank"], lambda s: s["lora_rank"]),
    "engine_seed": (12345, lambda llm: llm["seed"], lambda server: server["seed"]),
}


@pytest.mark.parametrize("rule", ENGINE_RULES)
def test_both_integrations_start_vllm_by_the_shared_rule(rule, start_both, monkeypatch):
    value, in_process, server = ENGINE_RULES[rule]
    real = getattr(vllm_options, rule)
    monkeypatch.setattr(vllm_options, rule, lambda *args, **kwargs: value)
    llm, options = _started(start_both)
    assert in_process(llm) == value and server(options) == value
    monkeypatch.setattr(vllm_options, rule, real)
    llm, options = _started(start_both)
    assert in_process(llm) == server(options) != value  # the real rule, the same in both


def _requests(rollout, params: SamplingParams) -> list[dict]:
    """``n``, ``top_p`` and ``seed`` of vLLM's ``SamplingParams`` of every request ``rollout``
    sends for three prompts, sorted by seed (the servers' requests run concurrently)."""
    in_process = not hasattr(rollout, "_servers")
    sent = rollout.llm.sampled if in_process else rollout._servers[0].bodies
    sent.clear()
    rollout.generate(["1+2=", "35+7=", "9+99="], params)
    fields = [
        {key: getattr(sp, key) for key in ("n", "top_p", "seed")}
        if in_process
        else {key: sp["sampling_params"][key] for key in ("n", "top_p", "seed")}
        for sp in sent
    ]
    return sorted(fields, key=lambda sp: sp["seed"])


def test_both_integrations_send_greedy_copies_by_the_shared_rule(start_both, monkeypatch):
    """Greedy: vLLM refuses ``n > 1``, so each of a prompt's samples is its own request."""
    asked = []
    real = vllm_options.requests_per_prompt
    monkeypatch.setattr(vllm_options, "requests_per_prompt", lambda p: asked.append(p) or real(p))
    greedy = SamplingParams(num_samples=2, greedy=True, seed=0)
    in_process, servers = (_requests(rollout, greedy) for rollout in start_both())
    assert asked == [greedy, greedy]  # once per integration
    assert len(in_process) == len(servers) == 6 and {r["n"] for r in in_process + servers} == {1}


def test_both_integrations_build_requests_by_the_shared_rule(start_both, monkeypatch):
    real = vllm_options.sampling_args
    monkeypatch.setattr(
        vllm_options, "sampling_args", lambda *a, **k: {**real(*a, **k), "top_p": 0.25}
    )
    params = SamplingParams(num_samples=2, seed=2**31 + 5)
    in_process, servers = (_requests(rollout, params) for rollout in start_both())
    assert in_process == servers == [{"n": 2, "top_p": 0.25, "seed": 6 + i} for i in range(3)]


def test_both_integrations_draw_the_seed_by_the_shared_rule(start_both):
    """Without ``params.seed``, both draw one from torch's generator (a resumed run draws the
    same): request ``i`` is seeded ``draw_seed + i``."""
    params = SamplingParams(num_samples=2)
    both = start_both()
    seeded = []
    for rollout in both:
        torch.manual_seed(3)
        seeded.append(_requests(rollout, params))
    in_process, servers = seeded
    torch.manual_seed(3)
    drawn = draw_seed(params)
    assert [r["seed"] for r in in_process] == [r["seed"] for r in servers]
    assert [r["seed"] for r in in_process] == [(drawn + i) % SEED_RANGE for i in range(3)]


def test_both_integrations_write_their_exports_by_the_shared_rule(
    start_both, monkeypatch, tmp_path
):
    """Without a ``workdir``, a shared temporary directory, removed at close; a given one is
    kept."""
    made = []

    def shared_tempdir(prefix: str) -> str:
        made.append(tmp_path / f"{prefix}{len(made)}")
        made[-1].mkdir()
        return str(made[-1])

    monkeypatch.setattr(vllm_options, "shared_tempdir", shared_tempdir)
    in_process, servers = start_both()
    assert [in_process.workdir, servers.workdir] == made
    assert (made[0] / "base" / "config.json").exists()  # the export vLLM loads
    in_process.close()
    servers.close()
    assert not any(path.exists() for path in made)
    given = tmp_path / "given"
    in_process, servers = start_both(workdir=str(given))
    assert in_process.workdir == servers.workdir == given and len(made) == 2
    in_process.close()
    servers.close()
    assert given.is_dir()


@pytest.mark.parametrize(
    ("config", "written"),
    [
        (VLLMConfig(dtype="bfloat16"), torch.bfloat16),  # a bf16 server (CUDA's auto): half
        (VLLMConfig(engine_kwargs={"lora_dtype": "bfloat16"}), torch.bfloat16),
        (VLLMConfig(), torch.float32),  # a float32 vLLM (a CPU's auto) holds it in float32
    ],
    ids=["served-bf16", "lora-dtype-bf16", "float32"],
)
def test_both_integrations_write_the_adapter_in_the_dtype_vllm_holds_it(
    start_both, monkeypatch, lora_engine, config, written
):
    """A LoRA sync writes the adapter in vLLM's LoRA dtype (``engine_kwargs.lora_dtype``, else
    the served dtype), which vLLM casts it to on load anyway: the same served adapter from half
    the bytes on a bf16 server, where every sync wrote (and vLLM re-read) float32 before."""
    from safetensors import safe_open

    from microrl.rollout.weights.server_syncs import HTTPAdapterSync

    monkeypatch.setattr(HTTPAdapterSync, "_load", lambda self, *args: None)  # no server runs
    sizes = {}
    for rollout in start_both(config):
        path = rollout.workdir / "adapter-7"
        rollout.weight_sync.push(lora_engine, 7)
        with safe_open(path / "adapter_model.safetensors", framework="pt") as tensors:
            dtypes = {tensors.get_tensor(name).dtype for name in tensors.keys()}  # noqa: SIM118
        assert dtypes == {written}, type(rollout).__name__
        sizes[type(rollout).__name__] = (path / "adapter_model.safetensors").stat().st_size
    assert len(set(sizes.values())) == 1  # the same file from both integrations
    trained = sum(p.numel() for p in lora_engine.module.parameters() if p.requires_grad)
    assert (
        trained * written.itemsize < next(iter(sizes.values())) < trained * written.itemsize + 2**14
    )

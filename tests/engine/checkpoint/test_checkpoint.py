"""Checkpoints (single process): exact resume, atomicity, refusal of bad directories.

The multi-rank variants (sharded save/load, resharding, a fresh process resuming) live in
tests/engine/parallel/test_distributed.py, the exports (merged model, PEFT adapter) in
``test_export.py``.
"""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
from checkpoint_utils import ADAM, actor_engine
from distributed_utils import actor_config, make_batch, tiny_model

from microrl.configs.engine import LoraConfig, OptimConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from microrl.engine.checkpoint import save_load as ckpt
from microrl.engine.checkpoint.export import export_merged_model


def _snapshot(engine) -> dict:
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = {
        f"{i}.{k}": v.clone()
        for i, entry in engine.optimizer.state_dict()["state"].items()
        for k, v in entry.items()
    }
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    return {"params": params, "optim": state, "lrs": lrs, "step": engine.global_step}


def _assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["lrs"] == b["lrs"]
    assert a["params"].keys() == b["params"].keys()
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), f"parameter {name} differs"
    assert a["optim"].keys() == b["optim"].keys()
    for name, value in a["optim"].items():
        assert torch.equal(value, b["optim"][name]), f"optimizer state {name} differs"


@pytest.mark.parametrize("lora", [0, 4])
def test_resume_is_exact(tmp_path, lora):
    k, m = 2, 3
    batches = [make_batch(seed=s) for s in range(k + m)]
    run = actor_engine(lora)
    for b in batches[:k]:
        run.train_batch(b)
    assert run.optimizer.state_dict()["state"], "optimizer state empty: the check would be vacuous"
    run.save_checkpoint(tmp_path / "ckpt")
    for b in batches[k:]:
        run.train_batch(b)
    expected = _snapshot(run)

    torch.manual_seed(1234)  # a different RNG stream and LoRA init before the load
    random.seed(1234)
    resumed = actor_engine(lora, seed=0)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == k
    for b in batches[k:]:
        resumed.train_batch(b)
    _assert_same(expected, _snapshot(resumed))


def test_checkpoint_holds_only_json_and_safetensors_and_loads_without_pickle(tmp_path, monkeypatch):
    engine = actor_engine(4)
    engine.train_batch(make_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert files and all(p.suffix in (".json", ".safetensors") for p in files), files
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    # Only the adapter is stored under LoRA.
    model_keys = [k for k in manifest["tensors"] if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys

    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint loading unpickled something")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    real_load = torch.load
    monkeypatch.setattr(
        torch,
        "load",
        lambda *a, **kw: real_load(*a, **kw) if kw.get("weights_only", True) else forbidden(),
    )
    fresh = actor_engine(4)
    fresh.load_checkpoint(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(
        engine.module.named_parameters(), fresh.module.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("where", ["tensors", "manifest"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, where):
    engine = actor_engine(4)
    engine.train_batch(make_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    before = _snapshot(engine)
    engine.train_batch(make_batch(seed=7))

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    if where == "tensors":  # inside DCP's write of the tensor files
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", boom)
    else:  # after the data, while writing the completion marker
        real = ckpt.write_json
        monkeypatch.setattr(
            ckpt, "write_json", lambda p, o: boom() if p.name == "manifest.json" else real(p, o)
        )
    # The error itself: DCP wraps its writers' errors in a CheckpointException (a BaseException
    # whose message names only ranks), which the engine unwraps.
    with pytest.raises(OSError, match="simulated"):
        engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "temporary files left behind"
    restored = actor_engine(4)
    restored.load_checkpoint(tmp_path / "ckpt")
    _assert_same(before, _snapshot(restored))


def test_incomplete_or_missing_directory_is_refused(tmp_path):
    engine = actor_engine(4)
    engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "nothing")
    (tmp_path / "partial" / "state").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not a complete microrl checkpoint"):
        engine.load_checkpoint(tmp_path / "partial")
    shard = next((tmp_path / "ckpt" / "state").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated after the manifest was written
    with pytest.raises(CheckpointError, match=r"incomplete or corrupt: state/"):
        engine.load_checkpoint(tmp_path / "ckpt")
    assert not ckpt.is_complete_checkpoint(tmp_path / "ckpt")


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    engine = actor_engine(4)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        engine.save_checkpoint(tmp_path / "notes")
    with pytest.raises(ValueError, match="refusing to replace"):
        export_merged_model(engine.module, tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "precious"
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.save_checkpoint(tmp_path / "ckpt")  # replacing a checkpoint is fine
    assert ckpt.is_complete_checkpoint(tmp_path / "ckpt")


def test_mismatched_model_or_config_is_refused(tmp_path):
    engine = actor_engine(4)
    engine.train_batch(make_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"lora\.rank \(4 -> 8\)"):
        actor_engine(8).load_checkpoint(tmp_path / "ckpt")
    # Without the config check, the tensor shapes name the mismatch.
    other = actor_engine(8)
    untouched = {n: p.detach().clone() for n, p in other.module.named_parameters()}
    with pytest.raises(
        CheckpointError, match=r"shape/dtype differs: .*lora_A.*\[4, 32\].*\[8, 32\]"
    ):
        load_checkpoint(tmp_path / "ckpt", model=other.module, optimizer=other.optimizer)
    wider = ActorEngine(tiny_model(0, hidden=48), engine.config)
    with pytest.raises(CheckpointError, match=r"shape/dtype differs"):
        wider.load_checkpoint(tmp_path / "ckpt")
    full = actor_engine(0)
    with pytest.raises(CheckpointError, match=r"lora\.rank \(4 -> 0\)"):
        full.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(
        CheckpointError, match=r"not in the checkpoint: model\.causal_lm\.lm_head\.weight"
    ):
        load_checkpoint(tmp_path / "ckpt", model=full.module, optimizer=full.optimizer)
    sgd = actor_engine(4, optim=OptimConfig(name="sgd", lr=1.0))
    with pytest.raises(CheckpointError, match="holds AdamW state, the optimizer is SGD"):
        load_checkpoint(tmp_path / "ckpt", model=sgd.module, optimizer=sgd.optimizer)
    # A refused load changed no parameter.
    for name, param in other.module.named_parameters():
        assert torch.equal(param, untouched[name]), name


def test_changed_hyperparameter_warns_but_loads(tmp_path):
    engine = actor_engine(4)
    engine.save_checkpoint(tmp_path / "ckpt")
    changed = actor_engine(4, seq_len_norm=None, temperature=0.7)
    with pytest.warns(UserWarning, match=r"temperature \(1\.0 -> 0\.7\)"):
        changed.load_checkpoint(tmp_path / "ckpt")


def test_rng_states_roundtrip(tmp_path):
    model = torch.nn.Linear(3, 2)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "ckpt", model=model, step=5)
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    info = load_checkpoint(tmp_path / "ckpt", model=model)
    assert info.step == 5 and info.world_size == 1
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_tied_embeddings_full_finetune_roundtrip(tmp_path):
    engine = ActorEngine(tiny_model(0, tie=True), actor_config(fused=False, optim=ADAM))
    engine.train_batch(make_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    fresh = ActorEngine(tiny_model(5, tie=True), actor_config(fused=False, optim=ADAM))
    fresh.load_checkpoint(tmp_path / "ckpt")
    _assert_same(_snapshot(engine), _snapshot(fresh))


def test_critic_roundtrip(tmp_path):
    from microrl.configs.engine import CriticConfig

    config = CriticConfig(micro_batch_size=3, optim=ADAM, lora=LoraConfig(rank=4, alpha=8.0))
    engine = CriticEngine(tiny_model(0), config)
    engine.train_batch(make_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    fresh = CriticEngine(tiny_model(0), CriticConfig(**{**config.__dict__, "seed": 3}))
    with pytest.warns(UserWarning, match="seed"):
        fresh.load_checkpoint(tmp_path / "ckpt")
    _assert_same(_snapshot(engine), _snapshot(fresh))


def test_a_learning_rate_changed_on_resume_takes_effect(tmp_path):
    """The config's optimizer settings win over the saved ones: a new lr given on resume is the
    one the optimizer (and the schedule) step with; moments still come from the checkpoint."""
    run = actor_engine(0)
    run.train_batch(make_batch(seed=0))
    run.save_checkpoint(tmp_path / "ckpt")
    lr = ADAM.lr / 4
    resumed = actor_engine(0, optim=OptimConfig(name="adamw", lr=lr, weight_decay=0.01))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert all(g["lr"] == lr and g["weight_decay"] == 0.01 for g in resumed.optimizer.param_groups)
    assert resumed.lr_scheduler.base_lrs == [lr] * len(resumed.optimizer.param_groups)
    assert resumed.optimizer.state_dict()["state"], "the moments were not restored"
    assert resumed.train_batch(make_batch(seed=1))["lr"] == lr

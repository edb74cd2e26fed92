"""Which base model a run starts from (``model.path``), with no network in the tests:

- a Hugging Face Hub id reaches the download unchanged, and the recipe trains on its snapshot;
  no toy model is built for it;
- the toy model is built only at the examples' own paths or with ``model.build_toy=true``;
- a missing local path, or a download that fails, is a one-line error saying how to download;
- ``microrl.hub.is_hub_name`` tells Hub ids from local-looking paths.
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
from example_utils import TINY_RL, load_example

from microrl.configs.run import TOY_MODEL_PATHS, ModelConfig, TaskConfig, WarmStartConfig
from microrl.hub import is_hub_name
from microrl.run import Dist, prepare_base_model, read_metrics
from microrl.run.toy_model import build_model, build_tokenizer, is_checkpoint

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
TINY_TASK = TaskConfig(max_operand=9, eval_size=8)


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``huggingface_hub.snapshot_download`` (what microrl calls) answering from a local "cache"
    that holds a tiny checkpoint; the repo ids it was asked for."""
    snapshot = tmp_path / "hf-cache" / "snapshot"
    tokenizer = build_tokenizer()
    build_model(TINY, tokenizer).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    asked: list[str] = []

    def snapshot_download(repo_id: str, **kwargs) -> str:
        asked.append(repo_id)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)  # a fresh working directory: nothing named Qwen/ in it
    return asked


def test_a_hub_id_is_downloaded_not_built(fake_hub: list[str], tmp_path: Path) -> None:
    cfg = ModelConfig(path=HUB_ID)
    tokenizer, path = prepare_base_model(cfg, TaskConfig(), Dist(), 4, log=lambda _: None)
    assert fake_hub == [HUB_ID]  # the id, unchanged
    assert path == str(tmp_path / "hf-cache" / "snapshot") and is_checkpoint(path)
    assert tokenizer.padding_side == "left"
    assert not (tmp_path / "Qwen").exists()  # no toy model saved under the id


def test_the_recipe_trains_on_a_hub_model(fake_hub: list[str], tmp_path: Path, capsys) -> None:
    args = [
        *TINY_RL,
        f"model.path={HUB_ID}",
        "task.max_operand=9",
        "task.eval_size=8",
        "output.dir=out",
        "output.progress=false",
        "output.tensorboard=false",
        "output.plot=false",
        "train.steps=1",
    ]
    assert load_example("grpo_lora").main(args) == 0
    assert fake_hub[0] == HUB_ID
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [0, 1]
    out = capsys.readouterr().out
    assert "warm-starting" not in out and "loading it from the Hugging Face Hub" in out
    assert not (tmp_path / "Qwen").exists()


def test_a_failed_download_says_how_to_download(tmp_path, monkeypatch) -> None:
    def offline(repo_id: str, **kwargs) -> str:
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        prepare_base_model(ModelConfig(path=HUB_ID), TaskConfig(), Dist(), 4, log=lambda _: None)
    message = str(info.value)
    assert "\n" not in message
    assert f"model.path='{HUB_ID}'" in message and "OSError: We couldn't connect" in message
    assert f"hf download {HUB_ID} --local-dir models/Qwen2.5-0.5B-Instruct" in message


@pytest.mark.parametrize(
    "path", ["./models/mine", "/nonexistent/models/mine", "~/no-such-model-here", "outputs/mine"]
)
def test_a_missing_local_path_is_an_error_not_a_download(path, tmp_path, monkeypatch) -> None:
    def no_download(repo_id: str, **kwargs) -> str:
        raise AssertionError(f"downloaded {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()  # "outputs/mine": its directory is here, so it is local
    with pytest.raises(ValueError, match=r"does not exist: give a local checkpoint") as info:
        prepare_base_model(ModelConfig(path=path), TaskConfig(), Dist(), 4, log=lambda _: None)
    assert "\n" not in str(info.value)
    assert f"hf download <org/name> --local-dir {path}" in str(info.value)
    assert "model.build_toy=true" in str(info.value)
    assert not Path(path).expanduser().exists()  # nothing built there


def test_the_toy_model_is_built_at_the_examples_paths_or_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sizes = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 1,
        "num_heads": 2,
        "warm_start": WarmStartConfig(max_steps=1, eval_every=1, batch_size=8),
    }
    assert ModelConfig().path in TOY_MODEL_PATHS  # the default: built there without asking
    for cfg in (
        ModelConfig(path="outputs/base/tiny-adder", **sizes),
        ModelConfig(path="./outputs/base/tiny-words", **sizes),  # the same path, written so
        ModelConfig(path=str(tmp_path / "mine"), build_toy=True, **sizes),
    ):
        _, path = prepare_base_model(cfg, TINY_TASK, Dist(), 4, log=lambda _: None)
        assert path == cfg.path and is_checkpoint(path)
    # A toy model saved once is a checkpoint: reused, whatever build_toy says.
    again = ModelConfig(path=str(tmp_path / "mine"))
    assert prepare_base_model(again, TINY_TASK, Dist(), 4, log=print)[1] == again.path


def test_the_moe_toy_lives_beside_the_dense_one_and_never_loads_a_dense_checkpoint(
    tmp_path, monkeypatch
) -> None:
    """``model.toy_arch=moe`` at an example's toy path builds its own toy at ``<path>-moe``, so
    the dense toy saved there is not trained in its place; a ``build_toy`` path or a Hub id
    that would give a model without experts is a ``ValueError`` naming the key (no download)."""
    from transformers import AutoConfig

    monkeypatch.chdir(tmp_path)
    sizes = dict(TINY.__dict__, warm_start=WarmStartConfig(max_steps=1, eval_every=1, batch_size=8))
    dense = ModelConfig(**{**sizes, "path": "outputs/base/tiny-adder"})
    moe = ModelConfig(**{**sizes, "path": "./outputs/base/tiny-adder", "toy_arch": "moe"})
    assert moe.toy_path() == "outputs/base/tiny-adder-moe" and dense.toy_path() == dense.path
    quiet = dict(log=lambda _: None)
    assert prepare_base_model(dense, TINY_TASK, Dist(), 4, **quiet)[1] == dense.path
    _, path = prepare_base_model(moe, TINY_TASK, Dist(), 4, **quiet)
    assert path == "outputs/base/tiny-adder-moe"
    assert AutoConfig.from_pretrained(path).model_type == "qwen3_moe"
    assert AutoConfig.from_pretrained(dense.path).model_type == "llama"  # left as it was
    assert prepare_base_model(moe, TINY_TASK, Dist(), 4, **quiet)[1] == path  # reused
    tokenizer, own = build_tokenizer(), str(tmp_path / "mine")
    build_model(TINY, tokenizer).save_pretrained(own)  # a dense checkpoint
    tokenizer.save_pretrained(own)
    mine = ModelConfig(**{**sizes, "path": own, "build_toy": True, "toy_arch": "moe"})
    assert mine.toy_path() == own  # the user's own path: the toy asked for, there
    with pytest.raises(ValueError, match=r"^model.toy_arch='moe', but .* without experts"):
        prepare_base_model(mine, TINY_TASK, Dist(), 4, **quiet)
    hub = ModelConfig(path=HUB_ID, toy_arch="moe")
    with pytest.raises(ValueError, match=r"^model.toy_arch='moe' chooses .* leave model.toy_arch"):
        prepare_base_model(hub, TINY_TASK, Dist(), 4, **quiet)


def test_hub_names_and_local_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "data.jsonl").write_text("")
    for name in (HUB_ID, "gpt2", "openai/gsm8k"):
        assert is_hub_name(name), name
    for name in ("./x", "../x", "/x/y", "~/x", "a/b/c", "outputs/x", "data.jsonl", "", "a b"):
        assert not is_hub_name(name), name

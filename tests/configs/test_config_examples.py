"""Example configs: YAML + ``key.sub=value`` overrides into typed dataclasses, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from microrl.configs import ActorConfig, PolicyLossType
from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import config_to_yaml, describe_config, load_config
from microrl.losses import AggMode

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLES = [(GRPOExampleConfig, "grpo_lora.yaml"), (PPOExampleConfig, "ppo_lora.yaml")]


@pytest.mark.parametrize(("schema", "name"), EXAMPLES)
def test_yaml_loads_into_typed_config_and_opens_with_launch_command(schema, name) -> None:
    path = CONFIGS / name
    cfg = load_config(schema, path)
    assert isinstance(cfg, schema)
    assert isinstance(cfg.actor, ActorConfig)
    assert isinstance(cfg.actor.loss_agg_mode, AggMode)
    assert cfg.actor.lora.rank > 0
    first_lines = path.read_text().splitlines()[:3]
    assert first_lines[0].startswith("#")
    example = name.replace(".yaml", ".py")
    assert any(f"python examples/{example}" in line for line in first_lines), first_lines


@pytest.mark.parametrize(("schema", "name"), EXAMPLES)
def test_yaml_values_match_the_dataclass_defaults(schema, name) -> None:
    # The YAML documents the recipe; the dataclass defaults must not silently disagree with it.
    assert load_config(schema, CONFIGS / name) == load_config(schema)


def test_overrides_are_typed_and_nested() -> None:
    cfg = load_config(
        GRPOExampleConfig,
        CONFIGS / "grpo_lora.yaml",
        [
            "actor.optim.lr=1e-4",
            "actor.policy_loss.name=gspo",
            "actor.loss_agg_mode=seq-mean-token-mean",
            "actor.optim.grad_clip=null",
            "actor.lora.target_modules=[q_proj,v_proj]",
            "train.steps=7",
            "output.dir=/tmp/x",
        ],
    )
    assert cfg.actor.optim.lr == pytest.approx(1e-4)
    assert cfg.actor.policy_loss.name is PolicyLossType.GSPO
    assert cfg.actor.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_MEAN
    assert cfg.actor.optim.grad_clip is None
    assert cfg.actor.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.output.dir == "/tmp/x"


def test_saved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(PPOExampleConfig, None, ["actor.policy_loss.kl_coef=0.2", "gae.lam=0.9"])
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    assert "token-mean" in path.read_text()  # enums by value, as a user writes them
    assert load_config(PPOExampleConfig, path) == cfg


@pytest.mark.parametrize(
    ("override", "key"),
    [
        # unknown keys
        ("actor.optim.learning_rate=1e-3", "actor.optim.learning_rate"),
        ("trainer.steps=3", "trainer"),
        # wrong types
        ("train.steps=many", "train.steps"),
        ("actor.optim.lr=fast", "actor.optim.lr"),
        ("actor.policy_loss.name=dpo", "actor.policy_loss.name"),
        ("output.tensorboard=maybe", "output.tensorboard"),
        # out of range (dataclass __post_init__, nested sections)
        ("actor.lora.rank=-1", "actor.lora.rank"),
        ("actor.optim.lr=-1.0", "actor.optim.lr"),
        ("actor.temperature=0", "temperature"),
        ("gae.lam=1.5", "gae.lam"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
        ("model.warm_start.target_accuracy=2", "model.warm_start.target_accuracy"),
        ("train.kl_metric_every=-1", "train.kl_metric_every"),
        ("task.eval_size=0", "task.eval_size"),
        ("task.rewards.overlong_buffer=-1", "task.rewards.overlong_buffer"),
        ("task.rewards.overlong_penalty=-0.5", "task.rewards.overlong_penalty"),
        ("rollout.max_sampling_rounds=0", "rollout.max_sampling_rounds"),
        ("actor.mask_truncated=maybe", "actor.mask_truncated"),
        # cross-field
        ("train.mini_batch_size=7", "train.mini_batch_size"),
        ("actor.lora.rank=0", "actor.lora.rank"),
        (
            "task.rewards.overlong_buffer=4",
            "task.rewards.overlong_buffer",
        ),  # not below max_new_tokens=4
    ],
)
def test_invalid_values_raise_value_error_naming_the_key(override: str, key: str) -> None:
    schema = GRPOExampleConfig if not override.startswith("gae") else PPOExampleConfig
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        load_config(schema, None, [override])
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize("schema", [GRPOExampleConfig, PPOExampleConfig])
def test_a_full_fine_tune_trains_without_the_kl(schema) -> None:
    """No adapter, no adapter-off reference: a full fine-tune runs with the KL off, only."""
    full = ["actor.lora.rank=0", "train.kl_metric_every=0", "actor.policy_loss.kl_coef=0"]
    assert load_config(schema, None, full).actor.lora.rank == 0
    with pytest.raises(ValueError, match=r"kl_coef=0 and train\.kl_metric_every=0"):
        load_config(schema, None, [*full, "actor.policy_loss.kl_coef=0.1"])


@pytest.mark.parametrize("schema", [GRPOExampleConfig, PPOExampleConfig])
def test_the_bypass_is_refused_with_vllm(schema) -> None:
    """vLLM's log-probs are not the trainer's: the old log-prob pass cannot be skipped."""
    bypass = "actor.policy_loss.bypass_mode=true"
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.bypass_mode .*rollout\.backend=hf"):
        load_config(schema, None, ["rollout.backend=vllm", bypass])
    assert load_config(schema, None, [bypass]).actor.policy_loss.bypass_mode


@pytest.mark.parametrize("schema", [GRPOExampleConfig, PPOExampleConfig])
def test_dapos_knobs_are_off_by_default_and_ppo_refuses_dynamic_sampling(schema) -> None:
    cfg = load_config(schema, None, [])
    assert not cfg.rollout.dynamic_sampling and cfg.rollout.max_sampling_rounds == 4
    assert cfg.task.rewards.overlong_buffer == 0 and cfg.task.rewards.overlong_penalty == 1.0
    assert not cfg.actor.mask_truncated
    knobs = [
        "task.rewards.overlong_buffer=3",
        "actor.mask_truncated=true",
        "rollout.max_new_tokens=8",
    ]
    cfg = load_config(schema, None, knobs)
    assert cfg.task.rewards.overlong_buffer == 3 and cfg.actor.mask_truncated is True
    dynamic = ["rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2"]
    if schema is GRPOExampleConfig:
        assert load_config(schema, None, dynamic).rollout.dynamic_sampling is True
    else:
        with pytest.raises(ValueError, match=r"rollout\.dynamic_sampling .*false for PPO"):
            load_config(schema, None, dynamic)


def test_grpo_needs_groups() -> None:
    with pytest.raises(ValueError, match=r"rollout\.group_size"):
        load_config(GRPOExampleConfig, None, ["rollout.group_size=1"])
    assert load_config(PPOExampleConfig, None, ["rollout.group_size=1"]).rollout.group_size == 1


@pytest.mark.parametrize("override", ["steps", "=3", ""])
def test_malformed_override(override: str) -> None:
    with pytest.raises(ValueError, match=r"key\.sub=value"):
        load_config(GRPOExampleConfig, None, [override])


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(GRPOExampleConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(GRPOExampleConfig, bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"train\.stepz") as info:
        load_config(GRPOExampleConfig, unknown)
    assert "unknown.yaml" in str(info.value)
    with pytest.raises(TypeError, match="dataclass"):
        load_config(dict, None)


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        # OmegaConf's merge raises these without a key: traced to the leaf.
        ("actor.optim.betas=[0.9]", "actor.optim.betas", "two floats in [0, 1)"),
        ("critic.optim.betas=[0.9,0.99,0.1]", "critic.optim.betas", "2 floats, written [a,b]"),
        ("actor.optim.betas=[a,b]", "actor.optim.betas", "got [a, b]; it takes 2 floats"),
        ("actor.optim=3", "actor.optim", "a section"),
        ("model=3", "model", "a section"),
        (
            "task.rewards.functions={a: 1}",
            "task.rewards.functions",
            "a list of strings, written [a,b]",
        ),
        (
            "task.rewards.functions=null",
            "task.rewards.functions",
            "a list of strings, written [a,b]",
        ),
        # __post_init__ of a section two levels down, which knows only its own names.
        ("critic.optim.betas=[0.9,1.5]", "critic.optim.betas", "two floats in [0, 1)"),
        ("critic.optim.lr=-1", "critic.optim.lr", ">= 0"),
        ("critic.lora.dropout=1", "critic.lora.dropout", "[0, 1)"),
        ("rollout.vllm.gpu_memory_utilization=2", "rollout.vllm.gpu_memory_utilization", "(0, 1]"),
        ("model.warm_start.lr=0", "model.warm_start.lr", "> 0"),
        ("actor.policy_loss.clip_ratio_low=-1", "actor.policy_loss.clip_ratio_low", "> 0"),
    ],
)
def test_nested_errors_name_the_full_key_and_what_it_takes(override, key, expected) -> None:
    with pytest.raises(ValueError) as info:
        load_config(PPOExampleConfig, CONFIGS / "ppo_lora.yaml", [override])
    message = str(info.value)
    assert f"bad value for config key '{key}'" in message, message
    assert expected in message and "<root>" not in message and "$VALUE" not in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "train.steps=abc",
            "bad value for config key 'train.steps' (command-line override): got 'abc'; it takes "
            "an integer (RL steps",
        ),
        (
            "actor.optim.betas=[0.9]",
            "bad value for config key 'actor.optim.betas' (command-line override): got [0.9]; it "
            "takes 2 floats, written [a,b] (AdamW betas",
        ),
        (
            "critic.optim.lr=-1",
            "bad value for config key 'critic.optim.lr': optim.lr must be >= 0, got -1.0",
        ),
        # Only a key the schema does not have is an invalid key.
        ("train.stepz=3", "invalid config key 'train.stepz' (command-line override): Key 'stepz'"),
    ],
)
def test_a_bad_value_names_the_key_the_value_and_what_it_takes(override, message) -> None:
    with pytest.raises(ValueError) as info:
        load_config(PPOExampleConfig, None, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_a_files_nested_error_names_the_key_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("actor:\n  optim:\n    betas: [0.9]\n")
    with pytest.raises(ValueError, match=r"'actor\.optim\.betas' \(file .*mine\.yaml\)"):
        load_config(GRPOExampleConfig, path)


# The recipes' config keys: the leaves `--help` lists (describe_config). A key is a choice to
# defend (GRPO 164 / PPO 191 after the nested task and the endpoint type, which renamed keys and
# added none but task.images.max_pixels; + 4 per engine for mixture-of-experts models:
# routing_replay, router_loss's two coefficients, lora.target_parameters; + 2 for the toy MoE
# base and the sampler's routing: model.toy_arch, rollout.routing_replay), so the counts are
# pinned: a new key updates them with its docs.
KEY_COUNTS = {GRPOExampleConfig: 170, PPOExampleConfig: 201}


@pytest.mark.parametrize("schema", list(KEY_COUNTS))
def test_the_number_of_config_keys_is_a_decision(schema) -> None:
    assert len(describe_config(schema())) == KEY_COUNTS[schema]

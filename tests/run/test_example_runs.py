"""The examples' runs never lose work, and log for clusters.

- a run refuses an ``output.dir`` that holds a checkpoint unless ``--resume`` or ``--overwrite``;
- ``--resume`` takes the saved config and applies only the overrides given (and says which);
- a checkpoint an interrupted swap left in ``.checkpoint.old`` is found, restored and resumed;
- ``--overwrite`` deletes the previous run's outputs, and nothing else;
- with stdout not a terminal, one short plain line every ``output.log_every`` steps;
- ``--help`` lists the options, shows ``null`` for empty defaults and a description for every
  key; an unknown key is a usage error (exit code 2).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import config_to_yaml, describe_config, load_config
from microrl.run import Dist, Tracker, parse_cli, prepare_output, read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

TINY = [*TINY_MODEL, *TINY_RL, "output.tensorboard=false", "output.plot=false"]
SCHEMAS = [(GRPOExampleConfig, "grpo_lora.yaml"), (PPOExampleConfig, "ppo_lora.yaml")]


def _parse(argv: list[str], schema=GRPOExampleConfig, name="grpo_lora.yaml"):
    return parse_cli(schema, name, "test", argv)


def _saved_run(out: Path, overrides: list[str], where: str = "checkpoint") -> GRPOExampleConfig:
    """A directory as a run leaves it: its checkpoint (here only the saved config) and outputs."""
    cfg = load_config(GRPOExampleConfig, ROOT / "configs" / "grpo_lora.yaml", overrides)
    (out / where).mkdir(parents=True)
    (out / where / "config.yaml").write_text(config_to_yaml(cfg))
    return cfg


# ----------------------------------------------------------------------------- --help
@pytest.mark.parametrize(("schema", "name"), SCHEMAS)
def test_help_prints_null_and_a_description_for_every_key(schema, name, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(["--help"], schema, name)
    assert info.value.code == 0
    text = capsys.readouterr().out
    epilog = text[text.index("config keys") :].splitlines()[1:]
    entries = {}
    for line in epilog:
        match = re.fullmatch(r"  ([\w.]+)=(.*?)\s{2,}(\S.*)", line)
        assert match, f"not 'key=value  description': {line!r}"
        entries[match.group(1)] = (match.group(2), match.group(3))
    keys = [key for key, _, _ in describe_config(load_config(schema))]
    assert list(entries) == keys  # every key, each with a non-empty description
    assert entries["actor.optim.total_steps"][0] == "null"
    assert entries["actor.lora.target_modules"][0] == "null"
    assert entries["actor.optim.betas"][0] == "[0.9, 0.999]"
    assert "None" not in "\n".join(epilog)
    assert "--overwrite" in text and "--resume" in text


def test_every_config_key_has_a_description() -> None:
    for schema, _ in SCHEMAS:
        missing = [k for k, _, h in describe_config(schema()) if not h.strip()]
        assert not missing, missing


def test_help_values_parse_back_to_the_defaults() -> None:
    # What --help shows is what an override accepts: `key=value` of every row gives the defaults.
    cfg = load_config(GRPOExampleConfig)
    rows = describe_config(cfg)
    assert load_config(GRPOExampleConfig, None, [f"{k}={v}" for k, v, _ in rows]) == cfg


def test_help_lists_the_options(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "GRPO", ["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--config",
        "--resume",
        "key.sub=value",
        "actor.optim.lr=",
        "rollout.group_size=",
    ):
        assert option in text
    with pytest.raises(SystemExit) as info:
        parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "GRPO", ["train.stepz=3"])
    assert info.value.code == 2
    assert "train.stepz" in capsys.readouterr().err


def test_config_takes_a_preset_name_from_any_directory(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # as after a pip install: no configs/ folder here
    for name in ("qwen2.5-0.5b-instruct", "qwen2.5-0.5b-instruct.yaml"):
        cfg, _ = _parse(["--config", name, "output.dir=run"])
        assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.output.dir == "run"
    (tmp_path / "mine.yaml").write_text("train:\n  steps: 7\n")
    assert _parse(["--config", "mine.yaml"])[0].train.steps == 7  # a file is a file
    for wrong in ("qwen2.5-0.5b", "presets/qwen2.5-0.5b-instruct"):
        with pytest.raises(SystemExit) as info:
            _parse(["--config", wrong])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"--config {wrong!r} is neither a YAML file nor a preset name" in err
        assert "qwen2.5-0.5b-instruct, qwen2.5-0.5b-instruct-vllm, " in err


# ----------------------------------------------------------------------------- refusing, resuming
@pytest.mark.parametrize("where", ["checkpoint", ".checkpoint.old"])
def test_a_run_refuses_an_output_dir_holding_a_checkpoint(
    tmp_path: Path, where, capsys, monkeypatch
) -> None:
    out = tmp_path / "run"
    _saved_run(out, [], where)
    with pytest.raises(SystemExit) as info:
        _parse([f"output.dir={out}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"output.dir={out}" in err and "--resume" in err and "--overwrite" in err
    assert (out / where / "config.yaml").is_file()  # untouched
    # --print-config only reads: allowed.
    with pytest.raises(SystemExit) as info:
        _parse([f"output.dir={out}", "--print-config"])
    assert info.value.code == 0
    # Other ranks under torchrun reach the same verdict silently.
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as info:
        _parse([f"output.dir={out}"])
    assert info.value.code == 2 and capsys.readouterr().err == ""


def test_resume_takes_the_saved_config_and_applies_only_the_overrides(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    saved = _saved_run(
        out,
        [
            "actor.optim.lr=5e-4",
            "rollout.prompts_per_step=24",
            "rollout.group_size=4",
            "train.mini_batch_size=32",
            f"output.dir={out}",
        ],
    )
    cfg, args = _parse(["--resume", f"output.dir={out}", "train.steps=400"])
    assert cfg.actor.optim.lr == 5e-4 and cfg.rollout.group_size == 4  # not the YAML's 2e-3, 8
    assert cfg.train.steps == 400
    assert args.resume_changes == [("train.steps", "300", "400")]
    prepare_output(cfg, args, Dist())
    assert "changed by the command line: train.steps 300 -> 400" in capsys.readouterr().out
    # Nothing given: nothing changes, and it says so.
    cfg, args = _parse(["--resume", f"output.dir={out}"])
    assert cfg == saved and args.resume_changes == []
    prepare_output(cfg, args, Dist())
    assert "no key changed" in capsys.readouterr().out
    # Overrides are checked against the saved config: 48 divides its 24 x 4 rows, not the
    # YAML's 32 x 8.
    cfg, _ = _parse(["--resume", f"output.dir={out}", "train.mini_batch_size=48"])
    assert cfg.train.mini_batch_size == 48


def test_overrides_may_follow_the_options(tmp_path: Path) -> None:
    # `output.dir=X --resume train.steps=25`: overrides on both sides of an option all count.
    out = tmp_path / "run"
    _saved_run(out, [f"output.dir={out}"])
    cfg, args = _parse(
        [f"output.dir={out}", "--resume", "train.steps=25", "--debug", "train.seed=3"]
    )
    assert (cfg.train.steps, cfg.train.seed, args.debug) == (25, 3, True)
    assert args.overrides == [f"output.dir={out}", "train.steps=25", "train.seed=3"]
    cfg, args = _parse([f"output.dir={out}", "--overwrite", "train.steps=7"])
    assert cfg.train.steps == 7 and args.overwrite


def test_resume_errors(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    for argv, message in [
        (["--resume", f"output.dir={out}"], "holds no checkpoint"),
        (["--resume", "--overwrite", f"output.dir={out}"], "not allowed with"),
        (["--resume", "--config", str(ROOT / "configs/grpo_lora.yaml")], "not --config"),
    ]:
        with pytest.raises(SystemExit) as info:
            _parse(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_resume_restores_a_checkpoint_left_aside_by_a_killed_swap(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    _saved_run(out, ["actor.optim.lr=5e-4", f"output.dir={out}"], ".checkpoint.old")
    cfg, args = _parse(["--resume", f"output.dir={out}"])
    assert cfg.actor.optim.lr == 5e-4
    assert (out / ".checkpoint.old").is_dir()  # parsing only reads
    prepare_output(cfg, args, Dist())
    assert (out / "checkpoint" / "config.yaml").is_file() and not (out / ".checkpoint.old").exists()


def test_overwrite_deletes_the_previous_runs_outputs_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _saved_run(out, [])
    for name in (
        "adapter",
        "merged",
        "tensorboard",
        ".checkpoint.old",
        ".checkpoint.tmp",
        ".adapter.tmp",
    ):
        (out / name).mkdir()
        (out / name / "file").write_text("x")
    for name in ("metrics.jsonl", "samples.jsonl", "curves.png", "config.yaml", "notes.txt"):
        (out / name).write_text("x")
    (out / "mine").mkdir()
    cfg, args = _parse(["--overwrite", f"output.dir={out}"])
    prepare_output(cfg, args, Dist())
    assert sorted(p.name for p in out.iterdir()) == ["mine", "notes.txt"]


# ----------------------------------------------------------------------------- logs
class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _track(tmp_path: Path, tty: bool, progress: bool = True) -> str:
    stream = _Stream(tty)
    tracker = Tracker(
        tmp_path, total_steps=7, tensorboard=False, progress=progress, log_every=3, stream=stream
    )
    tracker.log(0, {"eval/accuracy": 0.25})  # the starting evaluation: no line of its own
    for step in range(1, 8):
        metrics = {"reward": 0.1 * step, "kl": 0.01, "loss": -0.5, "tokens_per_s": 1000.0}
        if step % 2 == 0:
            metrics["eval/accuracy"] = 0.5
        tracker.log(step, metrics)
    tracker.close(plot=False)
    return stream.getvalue()


def test_plain_lines_every_n_steps_without_a_terminal(tmp_path: Path) -> None:
    lines = _track(tmp_path, tty=False).splitlines()
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]  # and the last step
    assert re.fullmatch(
        r"step 3/7  0:00:0\d \(eta 0:00:0\d\)  reward 0\.200  accuracy 0\.500  kl 0\.01  "
        r"loss -0\.5  tokens/s 1000",
        lines[0],
    ), lines[0]  # reward: the mean of steps 1-3
    assert "reward 0.700" in lines[2]  # the window since the previous line: step 7 alone
    assert "\r" not in "".join(lines)
    # progress=false on a terminal: the same lines.
    assert _track(tmp_path, tty=True, progress=False).splitlines()[0].startswith("step 3/7")


def test_a_bar_on_a_terminal(tmp_path: Path) -> None:
    text = _track(tmp_path, tty=True)
    assert "\r" in text and "train:" in text and "step 3/7" not in text


def test_fresh_run_starts_an_empty_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n')
    Tracker(tmp_path, total_steps=1, tensorboard=False, stream=_Stream(False)).close(plot=False)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A finished 2-step GRPO run (its base model warm-started on the way)."""
    grpo_lora = load_example("grpo_lora")

    root = tmp_path_factory.mktemp("runs")
    args = [*TINY, f"model.path={root / 'base'}", f"output.dir={root / 'run'}"]
    assert grpo_lora.main([*args, "output.progress=false", "train.steps=2"]) == 0
    return root / "run", args


def test_a_run_killed_between_the_renames_of_its_last_save_resumes(
    finished_run, tmp_path: Path, capsys
) -> None:
    grpo_lora = load_example("grpo_lora")

    run, args = finished_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    args = [a for a in args if not a.startswith("output.dir=")] + [f"output.dir={out}"]
    # The state a kill between the two renames leaves: only .checkpoint.old.
    (out / "checkpoint").rename(out / ".checkpoint.old")
    with pytest.raises(SystemExit) as info:  # a fresh run refuses; the copy stays
        grpo_lora.main([*args, "train.steps=1"])
    assert info.value.code == 2 and (out / ".checkpoint.old").is_dir()
    capsys.readouterr()
    resume = ["--resume", f"output.dir={out}", "train.steps=3", "actor.optim.lr=5e-4"]
    assert grpo_lora.main(resume) == 0
    text = capsys.readouterr().out
    assert "changed by the command line: actor.optim.lr 0.002 -> 0.0005, train.steps 2 -> 3" in text
    assert "resumed from" in text and "at step 2" in text
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # The optimizer steps with the learning rate the config says, not the checkpoint's.
    assert records[2]["lr"] == 2e-3 and records[3]["lr"] == 5e-4
    assert (out / "checkpoint" / "run.json").is_file() and not (out / ".checkpoint.old").exists()


def test_redirected_stdout_gets_short_lines_every_n_steps(finished_run, tmp_path: Path) -> None:
    _, args = finished_run
    args = [a for a in args if not a.startswith("output.dir=")] + [f"output.dir={tmp_path}"]
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "grpo_lora.py"),
            *args,
            "train.steps=5",
            "output.log_every=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert all(len(line) < 300 for line in lines), max(lines, key=len)
    assert "\r" not in result.stdout + result.stderr  # no bar anywhere
    steps = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["2/5", "4/5", "5/5"], result.stdout
    assert "held-out greedy accuracy:" in result.stdout

"""The Python samples of docs/api.md (the README's tour) run as written (each in a fresh interpreter namespace; the own loop for 2 of its steps); its example
commands each write to their own output.dir; its log samples have the format the code prints and
describe the model it builds (rewritten from real runs by ``benchmarks/readme_samples.py``)."""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import load_config
from microrl.run.cli import config_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"  # the README's tour links its code samples there
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_the_api_page_has_the_tour_samples_and_an_own_loop() -> None:
    blocks = BLOCK.findall(API.read_text())
    text = "\n".join(blocks)
    for piece in ("fused_linear_logprob", "policy_loss", "loss_fn=", "class ", "(Engine)"):
        assert piece in text, piece
    assert "train_batch" in text and "make_rollout_backend" in text  # the own loop


def test_the_api_page_python_blocks_run(tmp_path: Path) -> None:
    blocks = BLOCK.findall(API.read_text())
    assert blocks
    # The own loop with 2 of its 30 steps (the page states what the 30 show), in a fresh
    # directory: its toy base model is built there.
    loop = next(i for i, b in enumerate(blocks) if "train_batch(batch[rows])" in b)
    assert "\nsteps = 30\n" in blocks[loop]
    blocks[loop] = blocks[loop].replace("\nsteps = 30\n", "\nsteps = 2\n")
    # One interpreter for all blocks (imports are paid once), a fresh namespace per block.
    runner = "import sys\nfor i, code in enumerate(sys.argv[1:]):\n    exec(compile(code, f'README block {i}', 'exec'), {'__name__': '__main__'})\n"
    result = subprocess.run(
        [sys.executable, "-c", runner, *blocks],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"held-out greedy accuracy after 2 steps: 0\.\d{3}\n", result.stdout)
    assert (tmp_path / "outputs" / "base" / "tiny-adder" / "config.json").is_file()


# ----------------------------------------------------------------------------- example commands
DOCS = [
    README,
    # The changelog records what changed, with the commands of its time: not ones to run.
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "changelog.md"),
    *sorted((ROOT / "examples").glob("*.py")),
    *sorted((ROOT / "microrl" / "recipes").glob("*.py")),  # the installed command's help
]
# A launch of an example, up to a comment, a redirect or the end of its inline code span.
COMMAND = re.compile(r"(?:python|torchrun)\b[^`#>\n]*?examples/(grpo|ppo)_lora\.py[^`#>\n]*")
# The installed command, which runs the same recipe: `microrl grpo ...`, `python -m microrl grpo
# ...`, `torchrun ... -m microrl grpo ...`.
INSTALLED = re.compile(
    r"(?:(?:python|torchrun)\b[^`#>\n]*?-m |(?<![\w/.-]))microrl (grpo|ppo)\b[^`#>\n]*"
)


def _as_example(command: str) -> str:
    """An installed command as the example command that runs the same recipe."""
    launcher, _, rest = command.partition("microrl ")
    recipe, _, args = rest.partition(" ")
    return f"{launcher.removesuffix('-m ') or 'python '}examples/{recipe}_lora.py {args}"


# Reuse an output.dir on purpose, or run nothing.
SAME_RUN_FLAGS = ("--resume", "--overwrite", "--help", "--print-config")


def _example_commands() -> dict[str, set[str]]:
    """output.dir -> the distinct example commands (README, docs, the examples' docstrings) that
    write there."""
    defaults = {
        "grpo": load_config(GRPOExampleConfig).output.dir,
        "ppo": load_config(PPOExampleConfig).output.dir,
    }
    runs: dict[str, set[str]] = {}
    for path in DOCS:
        text = re.sub(r"\\+\n\s*", " ", path.read_text())  # continued lines, in md and docstrings
        matches = [(m.group(0), m.group(1)) for m in COMMAND.finditer(text)]
        matches += [(_as_example(m.group(0)), m.group(1)) for m in INSTALLED.finditer(text)]
        for found_command, recipe in matches:
            command = " ".join(found_command.split())
            if "..." in command or any(flag in command.split() for flag in SAME_RUN_FLAGS):
                continue
            found = re.search(r"\boutput\.dir=(\S+)", command)
            preset = re.search(r"--config (\S+)", command)
            if found:
                out = found.group(1)
            elif preset:  # a preset (a file, or its name) names its own output.dir
                schema = GRPOExampleConfig if recipe == "grpo" else PPOExampleConfig
                path = ROOT / preset.group(1)
                path = path if path.is_file() else config_file(preset.group(1))
                out = load_config(schema, path).output.dir
            else:
                out = defaults[recipe]
            runs.setdefault(out, set()).add(command)
    return runs


def test_every_example_command_has_its_own_output_dir() -> None:
    # A directory that holds a run's checkpoint refuses another run (without --resume), so two
    # documented commands sharing one would fail the second time.
    runs = _example_commands()
    commands = {c for cs in runs.values() for c in cs}
    assert "python examples/grpo_lora.py" in commands and len(commands) >= 12, sorted(commands)
    # `microrl ppo output.dir=outputs/ppo_installed` (docs/recipes.md), as the example it runs
    assert "python examples/ppo_lora.py output.dir=outputs/ppo_installed" in commands
    shared = {out: sorted(cs) for out, cs in runs.items() if len(cs) > 1}
    assert not shared, f"commands sharing an output.dir: {shared}"
    # And each one's overrides are a valid config of its example.
    for command in commands:
        schema = GRPOExampleConfig if "grpo_lora.py" in command else PPOExampleConfig
        words = command.split(".py", 1)[1].split()
        load_config(schema, None, [w for w in words if "=" in w and not w.startswith("-")])


# ----------------------------------------------------------------------------- log samples
def _readme_samples():
    """The regeneration script (benchmarks/readme_samples.py) as a module: its markers."""
    spec = importlib.util.spec_from_file_location(
        "readme_samples", ROOT / "benchmarks" / "readme_samples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shape(line: str, path: str = "") -> str:
    """A log line with its path, numbers and padding abstracted away."""
    line = line.replace(path, "<path>") if path else line
    return " ".join(re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "<n>", line).split())


def _sample_blocks() -> tuple[list[str], list[str]]:
    samples = _readme_samples()
    text = README.read_text()
    blocks = list(samples.TEXT_BLOCK.finditer(text))
    main = next(b for b in blocks if b.group(1).startswith(samples.FIRST_LINE))
    quote = text.index(f"`{samples.SHORT_COMMAND}`")
    short = next(b for b in blocks if b.start() > quote)
    return main.group(1).splitlines(), short.group(1).splitlines()


def test_readme_log_samples_match_what_the_code_prints(tmp_path: Path) -> None:
    """The samples' lines have the format the code prints today, and the model they describe is
    the toy model the code builds. Rewritten by ``python benchmarks/readme_samples.py``."""
    from microrl.configs.run import ModelConfig, TaskConfig, WarmStartConfig
    from microrl.run import Dist, Tracker, prepare_base_model
    from microrl.run.toy_model import build_model, build_tokenizer
    from microrl.run.tracking import LINE_KEYS
    from microrl.tasks import AdditionTask

    main, short = _sample_blocks()
    # The warm-start lines, as prepare_base_model logs them (a 1-step warm start here).
    path = str(tmp_path / "base")
    cfg = ModelConfig(
        path=path,
        build_toy=True,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        warm_start=WarmStartConfig(max_steps=1, eval_every=1, batch_size=8),
    )
    logged: list[str] = []
    prepare_base_model(cfg, TaskConfig(max_operand=9, eval_size=8), Dist(), 4, log=logged.append)
    # A 1-step warm start stops below the target and says so; the README's run reached it.
    logged = [line for line in logged if not line.lstrip().startswith("the warm start stopped")]
    readme_path = "outputs/base/tiny-adder"
    warm = [line for line in main if line.startswith(("no checkpoint", "  warm-start", "saved"))]
    assert [_shape(x, readme_path) for x in warm if x != "  ..."][:1] + [
        _shape(x, readme_path) for x in warm[-2:]
    ] == [_shape(x, path) for x in logged[:1] + logged[-2:]], (warm, logged)
    # The step lines, as the Tracker writes them for the metrics each line shows.
    labels = {label: key for key, label, _ in LINE_KEYS}
    for line in [x for x in main + short if x.startswith("step ")]:
        step, total = map(int, line.split()[1].split("/"))
        shown = re.findall(r"  ([a-z/]+) -?[\d.]", line)
        stream = io.StringIO()
        tracker = Tracker(
            tmp_path / "track", total_steps=total, tensorboard=False, log_every=step, stream=stream
        )
        tracker.log(step, {labels[name]: 0.5 for name in shown})
        tracker.close(plot=False)
        assert _shape(line) == _shape(stream.getvalue().splitlines()[0]), (line, stream.getvalue())
    # The model: its parameter count, heads and class, in the first line and the prose.
    default = ModelConfig()
    model = build_model(default, build_tokenizer(AdditionTask.toy_alphabet))
    size = f"{sum(p.numel() for p in model.parameters()) / 1e3:.0f}k"
    assert f"warm-starting a {size}-parameter {type(model).__name__}" in main[0], main[0]
    prose = f"({size} parameters, {default.num_heads} heads of width {default.head_dim}"
    assert prose in README.read_text(), prose


def test_the_20_step_sample_starts_from_the_main_jobs_base() -> None:
    """Both samples come from one base model: the 20-step run's first line shows the accuracy of
    its step-0 evaluation (the next is at step train.eval_every), the main job's step-0 one."""
    main, short = _sample_blocks()
    start = next(x for x in main if x.startswith("held-out greedy accuracy at step 0:"))
    first_accuracy = start.split(":")[1].split()[0]
    assert load_config(GRPOExampleConfig).train.eval_every > 10
    assert short[0].startswith("step 10/20") and f"accuracy {first_accuracy} " in short[0], (
        start,
        short[0],
    )

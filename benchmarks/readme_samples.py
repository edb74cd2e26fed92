"""Regenerate the README's two log samples (README "Main job") from real runs of the main job.

    python benchmarks/readme_samples.py             # the main job (300 steps) and a 20-step run
    python benchmarks/readme_samples.py --dry-run   # the same runs; print the blocks, write nothing

In a fresh temporary working directory (so the base model is built at the default
``outputs/base/tiny-adder`` from nothing, as in a fresh clone), with stdout to a file as the
README says, it runs:

1. ``python examples/grpo_lora.py`` (the main job: warm start, then 300 GRPO steps);
2. ``python examples/grpo_lora.py train.steps=20 output.dir=outputs/grpo_20_steps > train.log``
   (reusing the base the first run built).

Then it replaces, in README.md, the ``text`` block that shows run 1's log (the one holding its
first line; the warm-start and step lines shortened to their first and last, ``  ...`` between),
the ``text`` block after the sentence that quotes run 2's command (its step lines), and the
parameter count of the README's description of the model. It prints the figures of the README's
results table (held-out accuracy first -> last and after 50 steps, the sampled reward of the first
and last 10 steps, times) to copy by hand: that table also holds rows of other runs and machines.

``tests/examples/test_examples_readme.py`` checks the samples' format against the code and their
consistency (the 20-step run starts from the main job's step-0 accuracy). Extra ``key=value``
overrides after ``--`` go to both runs, for trying this script quickly; they imply ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SCRIPT = "examples/grpo_lora.py"
# The second sample's command, as the README quotes it (run 2 reuses run 1's base model).
SHORT_ARGS = ["train.steps=20", "output.dir=outputs/grpo_20_steps"]
SHORT_COMMAND = f"python {SCRIPT} {' '.join(SHORT_ARGS)} > train.log"
FIRST_LINE = "no checkpoint at outputs/base/tiny-adder: warm-starting"
ELIDED = ("  warm-start step", "step ")  # runs of these lines keep their first and last
TEXT_BLOCK = re.compile(r"```text\n(.*?)```", re.DOTALL)


def run(work: Path, args: list[str], log_name: str) -> tuple[str, float]:
    """``python examples/grpo_lora.py *args`` in ``work``, stdout to ``log_name``; its text and
    wall time."""
    log = work / log_name
    start = time.perf_counter()
    with log.open("w") as out, (work / f"{log_name}.stderr").open("w") as err:
        code = subprocess.run(
            [sys.executable, str(ROOT / SCRIPT), *args], cwd=work, stdout=out, stderr=err
        ).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        tail = (work / f"{log_name}.stderr").read_text()[-3000:]
        raise SystemExit(f"{SCRIPT} {' '.join(args)} exited with {code}:\n{tail}")
    return log.read_text(), seconds


def shorten(log: str) -> str:
    """The log with each run of warm-start or step lines cut to its first and last line."""
    lines = [line for line in log.splitlines() if line.strip()]
    out: list[str] = []
    i = 0
    while i < len(lines):
        kind = next((k for k in ELIDED if lines[i].startswith(k)), None)
        j = i
        while kind and j + 1 < len(lines) and lines[j + 1].startswith(kind):
            j += 1
        out += [lines[i], "  ...", lines[j]] if j - i >= 2 else lines[i : j + 1]
        i = j + 1
    return "\n".join(out) + "\n"


def step_lines(log: str) -> str:
    return "".join(f"{line}\n" for line in log.splitlines() if line.startswith("step "))


def replace_blocks(readme: str, main_block: str, short_block: str, params: str) -> str:
    blocks = list(TEXT_BLOCK.finditer(readme))
    main = next(b for b in blocks if b.group(1).startswith(FIRST_LINE))
    quote = readme.index(f"`{SHORT_COMMAND}`")
    short = next(b for b in blocks if b.start() > quote)
    for block, text in sorted(
        ((main, main_block), (short, short_block)), key=lambda x: -x[0].start()
    ):
        readme = readme[: block.start(1)] + text + readme[block.end(1) :]
    return re.sub(r"\(\d+k parameters,", f"({params} parameters,", readme, count=1)


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def table_figures(work: Path, main_log: str, main_seconds: float) -> str:
    records = [json.loads(line) for line in (work / "outputs/grpo_lora/metrics.jsonl").open()]
    evals = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    rewards = [r["reward"] for r in records if "reward" in r]
    first, last = min(evals), max(evals)
    rl = re.search(r"in (\d+)s of RL", main_log)
    warm = re.search(r"saved the base model to \S+ \((\d+)s, accuracy ([\d.]+)\)", main_log)
    return (
        f"held-out greedy accuracy {evals[first]:.3f} -> {evals[last]:.3f} "
        f"({evals.get(50, float('nan')):.3f} after 50 steps); sampled reward "
        f"{_mean(rewards[:10]):.2f} -> {_mean(rewards[-10:]):.2f} (first/last 10 steps); "
        f"{rl.group(1) if rl else '?'} s of RL; warm start {warm.group(1) if warm else '?'} s "
        f"to {warm.group(2) if warm else '?'} on training prompts; {main_seconds:.0f} s in all"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="print the blocks; write nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs (implies --dry-run)")
    args = parser.parse_args()
    dry_run = args.dry_run or bool(args.overrides)
    work = Path(tempfile.mkdtemp(prefix="readme-samples-"))
    print(f"working in {work}; run 1 (the main job) takes minutes", flush=True)
    main_log, main_seconds = run(work, list(args.overrides), "main.log")
    print("run 2 (20 steps)", flush=True)
    short_log, _ = run(work, [*SHORT_ARGS, *args.overrides], "train.log")
    main_block, short_block = shorten(main_log), step_lines(short_log)
    params = re.search(r"warm-starting a (\d+k)-parameter", main_log).group(1)
    print(
        f"\n{main_block}\n{short_block}\nREADME table: {table_figures(work, main_log, main_seconds)}"
    )
    if dry_run:
        print("dry run: README.md unchanged")
    else:
        README.write_text(replace_blocks(README.read_text(), main_block, short_block, params))
        print("README.md: the two log samples and the parameter count rewritten")
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""On-policy distillation on the main job's task: held-out accuracy against steps for GRPO alone,
pure distillation and the mix, in one run.

    python benchmarks/bench_distill.py                        # writes benchmarks/distill/
    python benchmarks/bench_distill.py --steps 40 --eval-every 5 --out /tmp/distill

The student is the main job's base model: the toy adder (microrl/run/toy_model.py) warm-started
to ``--student-accuracy`` greedy accuracy, on sums of operands up to ``--max-operand`` (19 by
default, smaller than the main job's 99, so the demo runs in minutes on a CPU). The teacher is a stronger policy of the same family: the
very same model (same seed, same supervised stream) warm-started further, to
``--teacher-accuracy``: the same tokenizer, so distillation is exact. Each mode then runs the
GRPO recipe (``microrl.recipes.grpo``, the toy defaults but ``--prompts`` prompts per step) from
the student for ``--steps`` steps, with the same seeds:

- ``grpo``: the task's reward only (``teacher.coef=0``; the teacher only measures the reverse
  KL, ``teacher/reverse_kl``);
- ``distill``: the teacher's per-token reverse KL only (``teacher.task_reward=false``);
- ``mix``: both (``teacher.coef=1``).

``--profile`` instead times the mix at ``rollout.max_staleness`` 0 and 1 (``--steps`` steps
each): the mean ``teacher/wait_s`` (the trainer's wait for the teacher: the whole scoring at
k = 0; at k = 1 the producer's thread scores while the trainer trains) and ``step_time``.

It writes ``distill.md`` (the table: held-out accuracy at each evaluation, and the first step
each mode reached GRPO's final accuracy) and ``distill.png`` (the curves, plus the reverse KL)
under ``--out``, and prints the table. Everything runs on the CPU, in this process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from microrl.configs.run import ModelConfig, TaskConfig, WarmStartConfig
from microrl.recipes import grpo
from microrl.run import Dist, read_metrics
from microrl.run.base_model import prepare_base_model

MODES = {
    "grpo": ["teacher.coef=0"],
    "distill": ["teacher.task_reward=false", "teacher.coef=1"],
    "mix": ["teacher.coef=1"],
}
LABELS = {"grpo": "GRPO alone", "distill": "pure distillation", "mix": "GRPO + distillation"}


def task_overrides(args: argparse.Namespace) -> list[str]:
    return [f"task.max_operand={args.max_operand}", f"task.eval_size={args.eval_size}"]


def build_models(root: Path, args: argparse.Namespace) -> dict:
    """The student and teacher checkpoints (built once; reused when present)."""
    found = {}
    task = TaskConfig(max_operand=args.max_operand, eval_size=args.eval_size)
    for name, target in (("student", args.student_accuracy), ("teacher", args.teacher_accuracy)):
        cfg = ModelConfig(
            path=str(root / name),
            build_toy=True,
            warm_start=WarmStartConfig(target_accuracy=target, max_steps=6000),
        )
        prepare_base_model(cfg, task, Dist(), max_new_tokens=4)
        found[name] = str(root / name)
    return found


def run_mode(mode: str, models: dict, out: Path, args: argparse.Namespace) -> list[dict]:
    run_dir = out / "runs" / mode
    argv = [
        f"model.path={models['student']}",
        f"teacher.path={models['teacher']}",
        f"train.steps={args.steps}",
        f"train.eval_every={args.eval_every}",
        f"rollout.prompts_per_step={args.prompts}",
        f"train.mini_batch_size={args.prompts * 8}",
        "output.progress=false",
        "output.plot=false",
        "output.tensorboard=false",
        f"output.dir={run_dir}",
        "--overwrite",
        *task_overrides(args),
        *MODES[mode],
    ]
    started = time.perf_counter()
    assert grpo.main(argv) == 0, mode
    print(f"{mode}: {time.perf_counter() - started:.0f} s")
    return read_metrics(run_dir / "metrics.jsonl")


def first_step_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, acc in curve if acc >= target), None)


def table(curves: dict, kls: dict, teacher_accuracy: float | None) -> str:
    steps = [s for s, _ in curves["grpo"]]
    target = curves["grpo"][-1][1]
    lines = [
        "| step | " + " | ".join(LABELS[m] for m in curves) + " |",
        "|---|" + "---|" * len(curves),
    ]
    for i, step in enumerate(steps):
        lines.append(f"| {step} | " + " | ".join(f"{curves[m][i][1]:.3f}" for m in curves) + " |")
    reach = []
    for mode, curve in curves.items():
        step = first_step_at(curve, target)
        reach.append(f"{LABELS[mode]}: {'not reached' if step is None else f'step {step}'}")
    summary = [
        "",
        f"GRPO's final held-out accuracy: {target:.3f}; first evaluation at or above it: "
        + "; ".join(reach)
        + ".",
        "Mean reverse KL to the teacher over the last 10 steps (nats/token): "
        + "; ".join(f"{LABELS[m]} {kls[m]:.3f}" for m in kls)
        + ".",
    ]
    if teacher_accuracy is not None:
        summary.append(f"The teacher's held-out greedy accuracy: {teacher_accuracy:.3f}.")
    return "\n".join(lines + summary) + "\n"


def plot(curves: dict, records: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, kl) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, curve in curves.items():
        acc.plot(*zip(*curve, strict=True), marker="o", label=LABELS[mode])
        scored = [r for r in records[mode] if "teacher/reverse_kl" in r]
        kl.plot([r["step"] for r in scored], [r["teacher/reverse_kl"] for r in scored])
    acc.set(xlabel="RL step", ylabel="held-out greedy accuracy", title="accuracy")
    kl.set(xlabel="RL step", ylabel="nats / token", title="reverse KL to the teacher")
    acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def teacher_accuracy(models: dict, out: Path, args: argparse.Namespace) -> float | None:
    """The teacher's held-out accuracy, from a 1-step run of it (its step-0 evaluation)."""
    run_dir = out / "runs" / "teacher_eval"
    argv = [
        f"model.path={models['teacher']}",
        "train.steps=1",
        "train.eval_every=1",
        "rollout.prompts_per_step=8",
        "train.mini_batch_size=64",
        "output.progress=false",
        "output.plot=false",
        "output.tensorboard=false",
        f"output.dir={run_dir}",
        "--overwrite",
        *task_overrides(args),
    ]
    assert grpo.main(argv) == 0
    return read_metrics(run_dir / "metrics.jsonl")[0].get("eval/accuracy")


def profile(models: dict, out: Path, args: argparse.Namespace) -> str:
    """The mix at k = 0 and k = 1: where the teacher's scoring time goes."""
    lines = [
        "| rollout.max_staleness | teacher/wait_s (mean) | step_time (mean) | steps |",
        "|---|---|---|---|",
    ]
    for k in (0, 1):
        MODES[f"mix_k{k}"] = ["teacher.coef=1", f"rollout.max_staleness={k}"]
        records = run_mode(f"mix_k{k}", models, out, args)[2:]  # after the first steps
        wait = sum(r["teacher/wait_s"] for r in records) / len(records)
        step = sum(r["step_time"] for r in records) / len(records)
        lines.append(f"| {k} | {wait:.4f} | {step:.3f} | {len(records)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (x8 rows)")
    parser.add_argument("--max-operand", type=int, default=19, help="a+b= with a, b <= this")
    parser.add_argument("--eval-size", type=int, default=100, help="held-out prompts")
    parser.add_argument("--student-accuracy", type=float, default=0.3)
    parser.add_argument("--teacher-accuracy", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/distill"))
    parser.add_argument("--models", type=Path, default=Path("outputs/distill_models"))
    parser.add_argument("--profile", action="store_true", help="k = 0 vs 1: the teacher's wait")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = build_models(args.models, args)
    if args.profile:
        text = profile(models, args.out, args)
        (args.out / "distill_profile.md").write_text(text)
        print(text)
        return
    records = {mode: run_mode(mode, models, args.out, args) for mode in MODES}
    curves = {
        m: [(r["step"], r["eval/accuracy"]) for r in rs if "eval/accuracy" in r]
        for m, rs in records.items()
    }
    kls = {
        m: sum(r["teacher/reverse_kl"] for r in rs[-10:] if "teacher/reverse_kl" in r)
        / len([r for r in rs[-10:] if "teacher/reverse_kl" in r])
        for m, rs in records.items()
    }
    text = table(curves, kls, teacher_accuracy(models, args.out, args))
    (args.out / "distill.md").write_text(text)
    (args.out / "distill.json").write_text(json.dumps({"curves": curves, "kl": kls}))
    plot(curves, records, args.out / "distill.png")
    print(text)


if __name__ == "__main__":
    main()

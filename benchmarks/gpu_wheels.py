"""The wheels a lent GPU machine (no package registry) needs for benchmarks/gpu_check.sh, into .whl/.

    python benchmarks/gpu_wheels.py                 # downloads into .whl/, prints the size table
    python benchmarks/gpu_wheels.py --list          # the table of what is there, nothing fetched

The lent machines come with torch and CUDA but reach no registry, so what microrl and the
second session's steps need beyond the machine's image travels as wheels in ``.whl/`` (an
ignored folder; ``carry`` of the device tool, 64 MiB in all), which ``setup`` installs with
``--no-deps``. The versions are those of the CI environment (.ci/run), so a GPU run tests what
CI tests (benchmarks/version_matrix.py reads both); built for the machine's Python
(``--python-version``, 3.12 on the machines lent so far) on x86-64 Linux. Nothing here is
installed on this machine. The download fails, naming the excess, if the folder would pass
64 MiB; the table printed is benchmarks/README.md's ("GPU check: the second session").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 64  # what the device tool carries beside the working tree, in all
# name==version: why it travels. The machine's image has torch, triton, numpy, accelerate, peft,
# and what the first session's transformers 5.17 needed; pyarrow (datasets, TRL: 40 MiB) too
# large to carry, is assumed there (setup's log lists any requirement left unmet: pip check).
WHEELS = {
    "tensordict==0.15.3": "the engine's batches",
    "pyvers==0.2.3": "tensordict's dependency",
    "cloudpickle==3.1.3": "tensordict's dependency",
    "omegaconf==2.4.0": "the config loader",
    "transformers==5.19.0": "vision-language models need >= 5.18 (engine/vision.py); CI's version",
    "tokenizers==0.23.3": "transformers 5.19 needs >= 0.23.1",
    "huggingface-hub==1.31.0": "transformers 5.19 needs >= 1.31",
    "safetensors==0.8.0": "transformers 5.19 needs >= 0.8",
    "regex==2026.12.2": "transformers 5.19 needs >= 2025.10.22",
    "peft==0.21.2": "CI's version (the machine had 0.21.0)",
    "trl==1.16.0": "bench_gpu_step.py's TRL side (GRPOTrainer)",
    "datasets==5.2.0": "TRL's train dataset, the recipes' prompt files",
    "dill==0.4.1": "datasets' dependency",
    "multiprocess==0.70.19": "datasets' dependency",
    "xxhash==4.1.0": "datasets' dependency",
    "fsspec==2026.9.0": "datasets' dependency (<= 2026.9.0)",
    "liger-kernel==0.7.0": "bench-kernel's Liger rows",
    "pytest==9.2.0": "the test steps",
    "pluggy==1.7.0": "pytest's dependency",
    "iniconfig==2.3.1": "pytest's dependency",
    "pytest-timeout==2.4.0": "the test suite's timeouts (pyproject's test extra)",
}


def download(folder: Path, python_version: str) -> None:
    """Every wheel of :data:`WHEELS` for ``python_version`` on manylinux x86-64, no dependency."""
    tag = python_version.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp"]
    command += ["--abi", f"cp{tag}", "--abi", "abi3", "--abi", "none"]
    for platform in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        command += ["--platform", platform]
    command += ["--dest", str(folder), *WHEELS]
    subprocess.run(command, check=True)


def table(folder: Path) -> tuple[list[str], float]:
    """The Markdown rows (wheel, MiB, why) of ``folder``'s wheels, and their total in MiB."""
    why = {name.split("==")[0].replace("-", "_").lower(): reason for name, reason in WHEELS.items()}
    rows, total = ["| wheel | MiB | why |", "|---|---|---|"], 0.0
    for path in sorted(folder.glob("*.whl")):
        mib = path.stat().st_size / 2**20
        total += mib
        reason = why.get(path.name.split("-")[0].lower(), "not in benchmarks/gpu_wheels.py")
        rows.append(f"| `{path.name}` | {mib:.1f} | {reason} |")
    rows.append(f"| total | {total:.1f} | of the {LIMIT_MIB} MiB carried |")
    return rows, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--list", action="store_true", help="only the table of what is there")
    args = parser.parse_args()
    folder = Path(args.dest)
    if not args.list:
        folder.mkdir(parents=True, exist_ok=True)
        download(folder, args.python_version)
    rows, total = table(folder)
    print("\n".join(rows))
    if total > LIMIT_MIB:
        sys.exit(
            f"{total:.1f} MiB in {folder}: more than the {LIMIT_MIB} MiB the device tool carries"
        )


if __name__ == "__main__":
    main()

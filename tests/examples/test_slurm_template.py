"""examples/slurm/grpo_lora.sbatch and vllm_servers.sh: the SLURM template for several nodes.

Both parse as bash and pass shellcheck (where it is installed). The batch script then runs
under stand-ins for SLURM's and the tools' commands (``scontrol``, ``srun``, ``torchrun``,
``vllm``, ``curl``: each records its arguments; ``srun`` runs its command once per node of
its ``--nodelist``), with a fake allocation: the torchrun command line of every node must parse
with torchrun's own argument parser (c10d on the first node, one process per GPU) and pass the
recipe's config loader (every key exists, every value is valid), and in the vLLM-servers variant
every server gets its own GPU and port, microrl's serve flags, and its URL reaches the trainers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "examples" / "slurm"
SCRIPTS = [SLURM / "grpo_lora.sbatch", SLURM / "vllm_servers.sh"]
NODES = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
JOB = "4242"

# The stand-ins; each records its argv NUL-separated in $RECORD, named by the node it ran on.
STUBS = {
    "scontrol": 'printf "%s\\n" $FAKE_NODES\n',
    "srun": """opts=()
while [[ $# -gt 0 && $1 == -* ]]; do opts+=("$1"); shift; done
nodelist=""
for opt in "${opts[@]}"; do [[ $opt == --nodelist=* ]] && nodelist=${opt#--nodelist=}; done
IFS=, read -ra nodes <<<"$nodelist"
printf "%s\\0" "${opts[@]}" >"$RECORD/srun-${nodes[0]}"
for node in "${nodes[@]}"; do SLURMD_NODENAME=$node "$@"; done
""",
    "torchrun": 'printf "%s\\0" "$@" >"$RECORD/torchrun-$SLURMD_NODENAME"\n',
    "vllm": 'printf "%s\\0" "$@" >"$RECORD/vllm-$SLURMD_NODENAME-$CUDA_VISIBLE_DEVICES"\n',
    "curl": "exit 0\n",
}


def _argv(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def _submit(tmp_path: Path, nodes: int, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the batch script as SLURM would on an allocation of ``nodes`` nodes."""
    bin_dir, record, venv = tmp_path / "bin", tmp_path / "record", tmp_path / "venv"
    for directory in (bin_dir, record, venv / "bin"):
        directory.mkdir(parents=True, exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nset -euo pipefail\n{body}")
        (bin_dir / name).chmod(0o755)
    (venv / "bin" / "activate").write_text("")  # the job's venv: the test's python is on PATH
    environment = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        RECORD=str(record),
        FAKE_NODES=" ".join(NODES[:nodes]),
        SLURM_JOB_ID=JOB,
        SLURM_JOB_NODELIST=f"gpu-[a-{'abcd'[nodes - 1]}]",
        MICRORL_DIR=str(ROOT),
        VENV=str(venv),
        SHARED_DIR=str(tmp_path / "shared"),
        **env,
    )
    environment.pop("VLLM_API_KEY", None)
    result = subprocess.run(
        ["bash", str(SCRIPTS[0])], env=environment, capture_output=True, text=True, timeout=60
    )
    return result, record


def _recipe_config(argv: list[str]) -> GRPOExampleConfig:
    """The recipe's config from the script's arguments, by the recipe's own loader."""
    assert argv[0] == "--config", argv
    return load_config(GRPOExampleConfig, ROOT / argv[1], argv[2:])


def _torchrun(record: Path, trainers: list[str]):
    """Every training node's torchrun arguments (one per node, all the same), parsed by torchrun."""
    argvs = [_argv(record / f"torchrun-{node}") for node in trainers]
    assert all(argv == argvs[0] for argv in argvs)
    assert sorted(p.name for p in record.glob("torchrun-*")) == [f"torchrun-{n}" for n in trainers]
    return get_args_parser().parse_args(argvs[0])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_the_scripts_parse_and_pass_shellcheck(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is not None:
        proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_one_torchrun_per_node_joins_the_first_nodes_rendezvous(tmp_path: Path) -> None:
    result, record = _submit(tmp_path, nodes=2)
    assert result.returncode == 0, result.stdout + result.stderr
    srun = _argv(record / "srun-gpu-a")
    assert {"--nodes=2", "--ntasks-per-node=1", "--nodelist=gpu-a,gpu-b"} <= set(srun), srun
    args = _torchrun(record, NODES[:2])
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "gpu-a:29500", JOB)
    assert args.training_script == "examples/grpo_lora.py"
    assert (ROOT / args.training_script).is_file()
    cfg = _recipe_config(args.training_script_args)
    assert cfg.output.dir == str(tmp_path / "shared" / "runs" / f"grpo-{JOB}")
    assert cfg.model.path == "Qwen/Qwen2.5-7B-Instruct"
    # 16 ranks: per rank 16 prompts a step and a quarter of its rows per optimizer step.
    assert (cfg.rollout.prompts_per_step, cfg.train.mini_batch_size) == (256, 512)
    assert cfg.rollout.backend == "hf" and not list(record.glob("vllm-*"))
    assert (tmp_path / "shared" / "tmp" / JOB).is_dir()  # TMPDIR on the shared directory

    # A second job in the same output.dir continues the run: --resume, no --config.
    (Path(cfg.output.dir) / "checkpoint").mkdir()
    result, record = _submit(tmp_path, nodes=2, OUTPUT_DIR=cfg.output.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    script_args = _torchrun(record, NODES[:2]).training_script_args
    assert script_args[0] == "--resume" and "--config" not in script_args
    load_config(GRPOExampleConfig, ROOT / "configs" / "grpo_lora.yaml", script_args[1:])


def test_vllm_servers_on_their_own_nodes(tmp_path: Path) -> None:
    """4 nodes, 2 of them servers: 16 servers (one per GPU) for the 16 training ranks."""
    result, record = _submit(tmp_path, nodes=4, VLLM_NODES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--nodelist=gpu-c,gpu-d" in _argv(record / "srun-gpu-c")
    args = _torchrun(record, NODES[:2])
    assert (args.nnodes, args.rdzv_endpoint) == ("2", "gpu-a:29500")
    cfg = _recipe_config(args.training_script_args)
    assert (cfg.rollout.backend, cfg.rollout.max_staleness) == ("vllm", 1)
    urls = cfg.rollout.server.url.split(",")
    assert urls == [f"http://{n}:{8000 + g}" for n in ("gpu-c", "gpu-d") for g in range(8)]
    for node in ("gpu-c", "gpu-d"):
        for gpu in range(8):  # its own GPU (CUDA_VISIBLE_DEVICES) and port
            argv = _argv(record / f"vllm-{node}-{gpu}")
            assert argv[:2] == ["serve", cfg.model.path], argv
            assert argv[argv.index("--host") + 1] == node
            assert argv[argv.index("--port") + 1] == str(8000 + gpu)
            # microrl's flags for a LoRA server (docs/async.md#vllm-servers)
            for flag in ("--skip-tokenizer-init", "--enable-scale-out", "--enable-lora"):
                assert flag in argv, flag
            assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
            assert argv[argv.index("--generation-config") + 1] == "vllm"
            assert int(argv[argv.index("--max-lora-rank") + 1]) >= cfg.actor.lora.rank
    assert not list(record.glob("vllm-gpu-a-*"))  # the training nodes run no server


def test_too_few_server_nodes_are_refused(tmp_path: Path) -> None:
    result, record = _submit(tmp_path, nodes=3, VLLM_NODES="1")
    assert result.returncode == 2
    assert "VLLM_NODES=1 gives 8 servers for 16 training ranks" in result.stderr
    assert not list(record.iterdir())  # nothing started

"""GRPO + LoRA: teach a tiny Llama-architecture model to add, rewarded only by a right answer.

Launch (CPU by default; the config is configs/grpo_lora.yaml, any key can be overridden; each run
writes to its own output.dir):

    python examples/grpo_lora.py                           # writes outputs/grpo_lora
    python examples/grpo_lora.py train.steps=100 actor.optim.lr=1e-3 output.dir=outputs/try
    torchrun --nproc_per_node 2 examples/grpo_lora.py output.dir=outputs/grpo_2ranks
                                                  # data parallel, FSDP2 (gloo on CPU)
    python examples/grpo_lora.py --resume                  # continue after Ctrl-C or a finished run
    python examples/grpo_lora.py rollout.backend=vllm output.dir=outputs/grpo_vllm
                                                  # sample with vLLM (docs/rollouts.md)
    python examples/grpo_lora.py rollout.max_staleness=1 output.dir=outputs/grpo_async
                                                  # asynchronous: a worker samples a step ahead
    python examples/grpo_lora.py task.name=dataset task.dataset.train_file=my.jsonl \\
        task.rewards.functions=my:score output.dir=outputs/my_data
                                                  # your data and reward (docs/tasks.md)
    python examples/grpo_lora.py model.path=Qwen/Qwen2.5-0.5B-Instruct task.name=dataset ...
                                                  # a Hugging Face Hub model, downloaded
    python examples/grpo_lora.py --overwrite               # start again over a previous run
    python examples/grpo_lora.py --help                    # every option, its default, its meaning
    python examples/grpo_lora.py --debug ...               # an error with its full traceback

The recipe is microrl/recipes/grpo.py: what GRPO does, then each RL step in order (this script
runs its ``main``; ``--help`` shows both). Installed as a package, without this repository, the
same recipe is the command ``microrl grpo`` (docs/recipes.md#the-microrl-command).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from microrl.recipes import grpo


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe (microrl/recipes/grpo.py), its --help opening with this script's commands."""
    return grpo.main(argv, usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())

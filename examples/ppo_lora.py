"""PPO + LoRA with a critic: the same addition task, a learned value baseline instead of groups.

Launch (CPU by default; the config is configs/ppo_lora.yaml, any key can be overridden):

    python examples/ppo_lora.py                            # writes outputs/ppo_lora
    python examples/ppo_lora.py train.steps=100 actor.policy_loss.kl_coef=0.05 output.dir=outputs/kl
    torchrun --nproc_per_node 2 examples/ppo_lora.py output.dir=outputs/ppo_2ranks
    torchrun --nproc_per_node 2 examples/ppo_lora.py actor.sequence_parallel_size=2 \\
        critic.sequence_parallel_size=2 output.dir=outputs/ppo_sp  # Ulysses: both split tokens
    python examples/ppo_lora.py --resume                   # continue it (saved config + overrides)
    python examples/ppo_lora.py rollout.backend=vllm output.dir=outputs/ppo_vllm
                                                  # sample with vLLM (docs/rollouts.md)
    python examples/ppo_lora.py rollout.max_staleness=1 output.dir=outputs/ppo_async
                                                  # asynchronous: a worker samples a step ahead
    python examples/ppo_lora.py task.name=dataset task.dataset.train_file=my.jsonl \\
        task.rewards.functions=my:score output.dir=outputs/my_data_ppo
                                                  # your data and reward (docs/tasks.md)

The recipe is microrl/recipes/ppo.py: what PPO does, then each RL step in order (this script
runs its ``main``; ``--help`` shows both). Installed as a package, without this repository, the
same recipe is the command ``microrl ppo`` (docs/recipes.md#the-microrl-command).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from microrl.recipes import ppo


def main(argv: Sequence[str] | None = None) -> int:
    """The recipe (microrl/recipes/ppo.py), its --help opening with this script's commands."""
    return ppo.main(argv, usage=__doc__)


if __name__ == "__main__":
    sys.exit(main())

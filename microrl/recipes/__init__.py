"""The recipes as an installed command: ``microrl grpo ...``, ``microrl ppo ...``.

Each recipe is a module with a ``main(argv, prog=..., usage=...)``: :mod:`microrl.recipes.grpo`
and :mod:`microrl.recipes.ppo`, which ``examples/grpo_lora.py`` and ``examples/ppo_lora.py`` run
too. :func:`main` is the ``microrl`` console script (and ``python -m microrl``): its first
argument names the recipe, the rest are the recipe's own (docs/recipes.md). A recipe's module is
imported only when it runs, so ``microrl --help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from microrl import __version__

__all__ = ["RECIPES", "main", "recipe_help"]

#: recipe name -> (its module, what it trains)
RECIPES = {
    "grpo": ("microrl.recipes.grpo", "GRPO + LoRA: group-normalised rewards, no critic"),
    "ppo": ("microrl.recipes.ppo", "PPO + LoRA: an actor and a critic, GAE advantages"),
}

_DESCRIPTION = """\
Run a microrl training recipe.

Each recipe takes the same options as the repository's examples/<recipe>_lora.py (the same code):
key.sub=value overrides of its config, --resume, --overwrite, --config, --print-config, --debug.
`microrl RECIPE --help` lists them, with every config key, its default and its meaning.
Under torchrun: `torchrun --nproc_per_node 2 -m microrl grpo output.dir=outputs/grpo_2ranks`.
"""


def recipe_help(usage: str, doc: str) -> str:
    """A recipe's ``--help`` description: ``usage`` (its title and launch commands), then what
    the recipe does (its module docstring ``doc`` after the first line)."""
    _, _, body = doc.partition("\n\n")  # after the title line
    return f"{usage.rstrip()}\n\n{body.strip()}\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microrl",
        usage="microrl [-h] [--version] RECIPE [ARGS ...]",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipes:\n"
        + "\n".join(f"  {name:<6}{summary}" for name, (_, summary) in RECIPES.items()),
    )
    parser.add_argument("--version", action="version", version=f"microrl {__version__}")
    parser.add_argument("recipe", metavar="RECIPE", help="a recipe below")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``microrl RECIPE ARGS...``: run ``RECIPE``'s ``main`` with ``ARGS``; its exit code.

    ``microrl -h`` or ``microrl --help`` lists the recipes (exit code 0); no recipe or an unknown
    one is an error naming the choices (exit code 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv[:1])  # exits: the help, the version, or an error
    name, *args = argv
    if name not in RECIPES:
        parser.error(f"unknown recipe {name!r}: choose {' or '.join(RECIPES)} (microrl --help)")
    module = importlib.import_module(RECIPES[name][0])
    return module.main(args, prog=f"microrl {name}")

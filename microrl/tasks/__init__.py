"""Tasks for the RL recipes: prompts, held-out prompts, rewards (README "Bring your own task").

:class:`Task` is what a recipe needs; :class:`AdditionTask` is the built-in test bed. The toy
tokenizer and model of the examples (:mod:`microrl.tasks.toy_model`) and their supervised warm
start (:mod:`microrl.tasks.warm_start`) are imported from their modules, on use.
"""

from microrl.tasks.addition import AdditionTask, exact_match_reward, parse_answer
from microrl.tasks.base import Problem, Task

__all__ = ["AdditionTask", "Problem", "Task", "exact_match_reward", "parse_answer"]

"""Tests of the examples (examples/, the README): the GRPO and PPO recipes end to end at tiny sizes
(in process, interrupted and resumed, under torchrun on 2 ranks), a user's copy of a recipe outside
the repository, and the README's Python samples.

Helper: ``example_utils`` (overrides that shrink a recipe, loading an example as a module) at
tests/, shared with the run, tasks and losses tests that run a recipe.
"""

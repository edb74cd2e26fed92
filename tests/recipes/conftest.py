"""Tests of ``microrl.recipes`` (microrl/recipes/): the ``microrl`` command (``microrl grpo``,
``microrl ppo``, ``python -m microrl``), its help and errors, and that it runs the very recipes
the example scripts run. The recipes' training behaviour is tested through the examples
(tests/examples/).
"""

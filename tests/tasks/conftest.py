"""Tests of ``microrl.tasks`` (microrl/tasks/): the addition task, prompt-file datasets, reward
functions by import path, the word problems.
"""

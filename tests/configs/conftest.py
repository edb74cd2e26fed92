"""Tests of ``microrl.configs`` (configs/): the engine configs' validation, and the example
configs (YAML files, ``key.sub=value`` overrides, typed dataclasses, errors naming the key).
"""

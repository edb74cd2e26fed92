"""Tests of ``microrl.run`` (microrl/run/): the command line (``--help``, overrides, ``--resume``,
``--overwrite``), output directories that never lose work, the progress lines, and the examples'
toy tokenizer. The runs are driven through the example scripts (``example_utils`` at tests/).
"""

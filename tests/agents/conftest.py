"""Tests of ``microrl.agents`` (microrl/agents/): tool-call parsing."""

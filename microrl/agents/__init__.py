"""Agents written against the OpenAI API: what they need from microrl (docs/rollouts.md#tool-parsers).

Import-light on purpose: each piece is imported from its own module (e.g.
:mod:`microrl.agents.tool_parsers`), so ``import microrl.agents`` pulls in nothing heavy.
"""

"""Tests of ``microrl.agents`` (microrl/agents/): the OpenAI-compatible endpoint driven by the real
``openai`` client, token-exact rows across calls, branches, failures and bounds; tool-call parsing."""

"""Loaded by vLLM into every process it starts (the plugin entry point): never the training engine."""

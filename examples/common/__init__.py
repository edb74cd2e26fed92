"""What the example trainings share, one concern per module.

``task`` (the addition task and its exact-match reward), ``model`` (tokenizer and tiny Qwen2,
built locally), ``base_model`` (load or warm-start the base model), ``rollout`` (sampling and the
token-aligned batch layout, greedy evaluation), ``tracking`` (progress bar or plain log lines,
JSONL, TensorBoard, plot), ``runtime`` (command line, output directory, ranks, Ctrl-C, run
checkpoints), ``session`` (evaluation, tracking and shutdown around the RL step).
"""

"""How trained weights reach a sampler (``WeightSync``), gathered or exported, and the probe
check every push gets."""

"""How trained weights reach a sampler (``WeightSync``) and the probe check every push gets."""

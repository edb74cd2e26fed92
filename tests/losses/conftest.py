"""Tests of ``microrl.losses`` (losses/): policy, KL, entropy, value and SFT losses against
per-token reference loops, their errors, aggregation and metric reduction, the normalisation
contract (any split, any number of ranks), advantage estimators, rollout/trainer mismatch and its
corrections, the importance-sampling-corrected KL, and batch statistics over 2 gloo ranks.

Helper: ``loss_utils`` (batches with garbage at masked positions, denominators), here.
"""

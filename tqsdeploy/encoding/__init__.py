"""Encoding: every (weight, tier, rounding) encoded once, calibrated wave by wave, checkpointed."""

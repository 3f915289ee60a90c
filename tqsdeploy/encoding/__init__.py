"""Encoding: every (weight, tier, rounding) encoded once, calibrated wave by wave, kept in the run's cache."""

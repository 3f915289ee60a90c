"""Scoring: one score run from a model and its contexts (prepare, sweep, γ, the run folder)."""

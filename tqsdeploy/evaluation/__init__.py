"""Evaluation: drift, degradation, gates, latency, reports and the frontier."""

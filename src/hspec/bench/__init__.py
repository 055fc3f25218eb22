"""Benchmark commands: each writes JSON + markdown under results/, stating machine, commit and settings."""

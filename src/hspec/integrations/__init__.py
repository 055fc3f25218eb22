"""Integrations of hspec with other serving engines (vLLM)."""

"""Integrations with training frameworks (torchtitan)."""

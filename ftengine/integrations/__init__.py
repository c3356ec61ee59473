"""Integrations with serving frameworks."""

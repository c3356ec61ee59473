"""Test doubles that stand in for hardware libraries; imported only by tests, never installed."""

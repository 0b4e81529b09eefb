"""Test utilities shared by tests/ and bench/ (multi-process launches, float64 references)."""

"""Exact fast algorithms, each beside a slow reference that a test compares it with."""

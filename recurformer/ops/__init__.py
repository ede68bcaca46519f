"""Exact fast algorithms, each next to the slow reference it is tested against."""

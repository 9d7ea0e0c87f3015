"""Benchmark plumbing: every point checks itself, the ratio summary."""

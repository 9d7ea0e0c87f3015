"""Benchmark and soak bodies used by ``tritonep bench`` and benchmarks/*.py."""

"""The test suite, one folder per layer of tritonep (docs/testing.md: the layout, the harness, the fixtures)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (README.md, docs/, examples/, benchmarks/)."""

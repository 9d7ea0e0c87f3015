"""The test suite, one folder per layer of tritonep (docs/testing.md: the layout, the harness, the fixtures)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (README.md, docs/, examples/, benchmarks/)."""


def load_script(relpath: str, name: str | None = None):
    """The module of the repository's script ``relpath`` (``examples/train_moe.py``, ``scripts/results_index.py``,
    ...), executed fresh under ``name`` (default: its file stem): scripts are not packages, so tests import them by
    path."""
    import importlib.util

    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

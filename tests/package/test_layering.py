"""Imports go one way (DEVELOPERS.md, docs/architecture.md): memory -> wire / kernels -> ep -> moe / balance ->
integrations / cli. Every ``tritonep`` import of every module (top-level and inside functions, absolute and relative)
is read with ``ast`` and must point to the same or a lower layer."""

import ast
import pathlib

import tritonep

ROOT = pathlib.Path(tritonep.__file__).parent
# package (or top-level module) -> layer; a module may import its own layer and any lower one
LAYER = {"errors": 0, "envs": 0, "memory": 1, "device": 2, "runtime": 2, "wire": 2, "reference": 2,
         "reference_checks": 2, "reference_moe": 2, "backends": 3, "ep": 3, "moe": 4, "balance": 4, "data": 4,
         "testing": 5, "bench": 5, "integrations": 6, "cli": 6}


def _imported_packages(path: pathlib.Path, source: str):
    """(line, tritonep package) of every tritonep import in ``source`` (the file at ``path`` under ROOT)."""
    rel = path.relative_to(ROOT).with_suffix("")
    modname = ["tritonep", *rel.parts]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = modname if path.name == "__init__.py" else modname[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            names = [target]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        for t in names:
            if len(t) > 1 and t[0] == "tritonep":
                yield node.lineno, t[1]


def _violations(path: pathlib.Path, source: str) -> list:
    rel = path.relative_to(ROOT)
    me = LAYER.get(rel.with_suffix("").parts[0])
    if me is None:  # tritonep/__init__.py and __main__: the package's front, above every layer
        return []
    return [f"{rel}:{line} imports tritonep.{pkg} (layer {LAYER[pkg]} > {me})"
            for line, pkg in _imported_packages(path, source) if pkg in LAYER and LAYER[pkg] > me]


def test_every_package_has_a_layer():
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert names <= set(LAYER), f"give these a layer here and in docs/architecture.md: {sorted(names - set(LAYER))}"


def test_imports_point_down():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        bad += _violations(path, path.read_text())
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import():
    path = ROOT / "memory" / "heap.py"
    assert _violations(path, "from ..ep.buffer import EPBuffer\n") == [
        "memory/heap.py:1 imports tritonep.ep (layer 3 > 1)"]
    assert _violations(path, "def f():\n    import tritonep.moe.layer\n") == [
        "memory/heap.py:2 imports tritonep.moe (layer 4 > 1)"]
    assert _violations(ROOT / "ep" / "buffer.py", "from ..memory import get_heap\nfrom . import config\n") == []

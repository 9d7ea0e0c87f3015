"""The house rules of tritonep's layout (docs/architecture.md), read from the source with ``ast``:

* imports go one way: every ``tritonep`` import of every module (top-level and inside functions, absolute and
  relative) points to the same or a lower layer (``errors`` / ``envs`` < ``memory`` < ``device`` < ``runtime``,
  ``wire`` < ``backends`` < ``ep`` < ``moe``, ``balance``, ``data`` < ``testing``, ``bench`` < ``integrations``,
  ``cli``; ``compat``, the compatibility front ends, with ``integrations``), and the packages' import graph has no
  circle;
* backends are reached only through their interface: outside ``tritonep/backends`` no module imports a backend's own
  modules (``tritonep.backends.triton``, ``tritonep.backends.nccl``, ...; the registry and the interface modules of
  ``tritonep.backends`` are the way in) or compares a value with a registered backend's name, and no backend imports
  another;
* configuration in one place: only ``tritonep/envs.py`` touches the process environment (``os.environ``,
  ``os.getenv``, ``os.putenv``, ``os.unsetenv``);
* device code beside its op: every ``@triton.jit`` of the package sits in a ``kernels/`` folder or in ``device/``;
* tests reach a buffer's backend only through the documented hook (``tests/support/hooks.py``): no ``._impl``, no
  ``._backend`` elsewhere.
"""

import ast
import pathlib

import tritonep
from tests import ROOT as REPO

ROOT = pathlib.Path(tritonep.__file__).parent
# package (or top-level module) -> layer; a module may import its own layer and any lower one
LAYER = {"errors": 0, "envs": 0, "memory": 1, "device": 2, "runtime": 3, "wire": 3, "reference": 3,
         "reference_checks": 3, "reference_moe": 3, "backends": 4, "ep": 5, "moe": 6, "balance": 6, "data": 6,
         "testing": 7, "bench": 7, "integrations": 8, "compat": 8, "cli": 8}
BACKEND_PACKAGES = sorted(p.name for p in (ROOT / "backends").iterdir()
                          if p.is_dir() and (p / "__init__.py").exists())


def _imports(path: pathlib.Path, source: str):
    """``(line, dotted module)`` of every import in ``source`` (the file at ``path`` under ROOT), relative ones
    resolved; ``from X import n`` gives ``X.n`` (which may be a module or a name in X)."""
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
            for a in node.names:
                yield node.lineno, ".".join(target + [a.name])
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def _imported_packages(path: pathlib.Path, source: str):
    """(line, tritonep package) of every tritonep import in ``source``."""
    for line, mod in _imports(path, source):
        t = mod.split(".")
        if len(t) > 1 and t[0] == "tritonep":
            yield line, t[1]


def _violations(path: pathlib.Path, source: str) -> list:
    rel = path.relative_to(ROOT)
    me = LAYER.get(rel.with_suffix("").parts[0])
    if me is None:  # tritonep/__init__.py and __main__: the package's front, above every layer
        return []
    return [f"{rel}:{line} imports tritonep.{pkg} (layer {LAYER[pkg]} > {me})"
            for line, pkg in _imported_packages(path, source) if pkg in LAYER and LAYER[pkg] > me]


def _sources():
    return {p: p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_every_package_has_a_layer():
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert names <= set(LAYER), f"give these a layer here and in docs/architecture.md: {sorted(names - set(LAYER))}"


def test_imports_point_down():
    bad = []
    for path, src in _sources().items():
        bad += _violations(path, src)
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import():
    path = ROOT / "memory" / "heap.py"
    assert _violations(path, "from ..ep.buffer import EPBuffer\n") == [
        "memory/heap.py:1 imports tritonep.ep (layer 5 > 1)"]
    assert _violations(path, "def f():\n    import tritonep.moe.layer\n") == [
        "memory/heap.py:2 imports tritonep.moe (layer 6 > 1)"]
    assert _violations(ROOT / "ep" / "buffer.py", "from ..memory import get_heap\nfrom . import config\n") == []


def _package_graph() -> dict:
    """package -> the tritonep packages its modules import (itself left out)."""
    graph: dict = {}
    for path, src in _sources().items():
        me = path.relative_to(ROOT).with_suffix("").parts[0]
        if me not in LAYER:
            continue
        graph.setdefault(me, set()).update(p for _, p in _imported_packages(path, src) if p in LAYER and p != me)
    return graph


def _circles(graph: dict) -> list:
    """Every strongly connected group of more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _module_graph() -> dict:
    """module -> the tritonep modules it imports (an import of a name resolved to the module that holds it)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(["tritonep"] + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for _, mod in _imports(path, path.read_text()):
            t = mod.split(".")
            hit = next((".".join(t[:i]) for i in range(len(t), 1, -1) if ".".join(t[:i]) in mods), None)
            if hit is not None and hit != name:
                deps.add(hit)
        graph[name] = deps
    return graph


def test_no_import_circle_between_packages_or_modules():
    assert _circles(_package_graph()) == []
    assert _circles(_module_graph()) == []  # function-level imports included
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check sees one


def _backend_of(module: str):
    """The backend package a dotted module belongs to (``tritonep.backends.<name>...``), else None."""
    t = module.split(".")
    return t[2] if len(t) > 2 and t[:2] == ["tritonep", "backends"] and t[2] in BACKEND_PACKAGES else None


def _backend_rule_violations(path: pathlib.Path, source: str) -> list:
    rel = path.relative_to(ROOT)
    parts = rel.with_suffix("").parts
    mine = parts[1] if parts[0] == "backends" and len(parts) > 1 and parts[1] in BACKEND_PACKAGES else None
    bad = []
    for line, mod in _imports(path, source):
        other = _backend_of(mod)
        if other is None:
            continue
        if parts[0] != "backends":
            bad.append(f"{rel}:{line} imports {mod} (a backend's module, outside tritonep/backends)")
        elif mine is not None and other != mine:
            bad.append(f"{rel}:{line} imports {mod} (another backend's module)")
    if parts[0] != "backends":
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Compare):
                continue
            for side in [node.left, *node.comparators]:
                vals = [side] if isinstance(side, ast.Constant) else \
                    list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else []
                names = {v.value for v in vals if isinstance(v, ast.Constant)} & set(BACKEND_PACKAGES)
                if names:
                    bad.append(f"{rel}:{node.lineno} compares with the backend name(s) {sorted(names)}")
    return bad


def test_backends_only_through_their_interface():
    assert BACKEND_PACKAGES == ["nccl", "triton"]
    bad = []
    for path, src in _sources().items():
        bad += _backend_rule_violations(path, src)
    assert not bad, "\n".join(bad)


def test_the_backend_check_sees_a_name_and_an_import():
    path = ROOT / "ep" / "buffer.py"
    assert _backend_rule_violations(path, "ok = self.backend in ('triton', 'nccl')\n") == [
        "ep/buffer.py:1 compares with the backend name(s) ['nccl', 'triton']"]
    assert _backend_rule_violations(path, "def f():\n    from ..backends.nccl.sync_free import x\n") == [
        "ep/buffer.py:2 imports tritonep.backends.nccl.sync_free.x (a backend's module, outside tritonep/backends)"]
    assert _backend_rule_violations(path, "from ..backends import build_backend\n") == []
    assert _backend_rule_violations(ROOT / "backends" / "nccl" / "backend.py", "from ..triton import calls\n") == [
        "backends/nccl/backend.py:1 imports tritonep.backends.triton.calls (another backend's module)"]


_ENV_CALLS = ("environ", "getenv", "putenv", "unsetenv", "environb")


def _env_uses(source: str) -> list:
    """Lines that touch the process environment (``os.environ`` / ``os.getenv`` / ..., or ``from os import
    environ``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in _ENV_CALLS and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in _ENV_CALLS for a in node.names):
            out.append(node.lineno)
    return sorted(out)


def test_only_envs_touches_the_environment():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p, src in _sources().items() if p != ROOT / "envs.py"
           for line in _env_uses(src)]
    assert not bad, f"the process environment outside tritonep/envs.py: {bad}"
    assert _env_uses("import os\nx = os.environ.get('A')\nfrom os import getenv\n") == [2, 3]


def _jit_outside_kernels(path: pathlib.Path, source: str) -> list:
    rel = path.relative_to(ROOT)
    if "kernels" in rel.parts[:-1] or rel.parts[0] == "device":
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if isinstance(f, ast.Attribute) and f.attr == "jit" or isinstance(f, ast.Name) and f.id == "jit":
                    out.append(f"{rel}:{node.lineno} {node.name}")
    return out


def test_every_triton_jit_sits_in_a_kernels_folder_or_device():
    bad = []
    for path, src in _sources().items():
        bad += _jit_outside_kernels(path, src)
    assert not bad, f"@triton.jit outside a kernels/ folder or device/: {bad}"
    assert _jit_outside_kernels(ROOT / "ep" / "x.py", "@triton.jit\ndef k(a):\n    pass\n") == ["ep/x.py:2 k"]
    assert _jit_outside_kernels(ROOT / "wire" / "kernels" / "x.py", "@triton.jit\ndef k(a):\n    pass\n") == []


def test_tests_reach_the_backend_only_through_the_hook():
    hook = REPO / "tests" / "support" / "hooks.py"
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (node.attr == "_impl" or node.attr == "_backend" and path != hook):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
    assert not bad, f"private backend state outside tests/support/hooks.py: {bad}"

"""Bounded dict caches of the host paths: :func:`tritonep.runtime.pool.remember` bounds them, and it is the only
place of the package that empties a dict once it holds its limit (read from the source with ``ast``)."""

import ast
import pathlib

import tritonep
from tritonep.runtime.pool import remember

ROOT = pathlib.Path(tritonep.__file__).parent


def test_remember_keeps_at_most_the_limit_and_returns_the_value():
    cache: dict = {}
    for i in range(10):
        v = object()
        assert remember(cache, i, v, 4) is v and cache[i] is v
        assert 1 <= len(cache) <= 4
    assert sorted(cache) == [8, 9]  # emptied when it held 4 (keys 4..7), then 8 and 9 kept
    cache = {}
    remember(cache, "a", 1, 2)
    assert remember(cache, "a", 2, 2) == 2 and cache == {"a": 2}  # a key written again: no growth, no emptying


def _own_bounds(source: str) -> list:
    """Lines of ``if len(X) >= / > N: ... X.clear()``: a cache bounded by hand instead of by :func:`remember`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        left = node.test.left
        if not (isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and left.func.id == "len"
                and len(left.args) == 1 and isinstance(node.test.ops[0], (ast.Gt, ast.GtE))):
            continue
        what = ast.dump(left.args[0])
        for sub in node.body:
            for n in ast.walk(sub):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "clear" \
                        and ast.dump(n.func.value) == what:
                    out.append(node.lineno)
    return out


def test_no_module_bounds_a_cache_by_hand():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(ROOT.rglob("*.py")) if p != ROOT / "runtime" / "pool.py"
           for line in _own_bounds(p.read_text())]
    assert not bad, "use tritonep.runtime.pool.remember for these bounded caches:\n" + "\n".join(bad)
    assert _own_bounds("if len(self._c) >= 64:\n    self._c.clear()\n") == [1]  # the check sees one
    assert _own_bounds("if len(a) > 3:\n    b.clear()\n") == []


def test_the_poison_launches_kept_stay_bounded(monkeypatch):
    from tritonep.compat.deep_ep import meta

    monkeypatch.setattr(meta, "_KEPT", 3)
    ops = meta.MetaOps("cpu")
    for n in range(1, 10):
        got = ops._poison_launch(2, n, 4, 0, 4)
        assert ops._poisons[(2, n, 4, 0, 4)] is got and len(ops._poisons) <= 3

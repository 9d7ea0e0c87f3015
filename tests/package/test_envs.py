"""Every TRITONEP_* value and the ``num_sms`` argument are checked: a bad one is a ConfigError naming it, never a
bare ValueError, a silently ignored value or a negative kernel grid."""

import pytest

from tritonep import envs
from tritonep.errors import ConfigError
from tests.support.tiles import tiles_of


@pytest.mark.parametrize("name,value,read", [
    ("TRITONEP_NUM_SMS", "abc", envs.num_sms),
    ("TRITONEP_NUM_SMS", "-4", envs.num_sms),
    ("TRITONEP_COMBINE", "puhs", envs.combine_kind),
    ("TRITONEP_CPU_HEAP_BYTES", "1e9", envs.cpu_heap_bytes),
    ("TRITONEP_CPU_HEAP_BYTES", "-5", envs.cpu_heap_bytes),
    ("TRITONEP_CPU_HEAP_BYTES", "0", envs.cpu_heap_bytes),
])
def test_bad_environment_value_is_a_config_error(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}={value!r}"):
        read()


def test_good_environment_values(monkeypatch):
    monkeypatch.setenv("TRITONEP_NUM_SMS", " 24 ")
    monkeypatch.setenv("TRITONEP_COMBINE", "pull")
    monkeypatch.setenv("TRITONEP_CPU_HEAP_BYTES", str(1 << 20))
    assert (envs.num_sms(), envs.combine_kind(), envs.cpu_heap_bytes()) == (24, "pull", 1 << 20)
    monkeypatch.setenv("TRITONEP_COMBINE", "")
    monkeypatch.setenv("TRITONEP_NUM_SMS", "0")
    assert (envs.num_sms(), envs.combine_kind()) == (0, "")


@pytest.mark.parametrize("num_sms", [-4, 2.5, "24", True])
def test_bad_num_sms_argument_is_a_config_error(num_sms):
    with pytest.raises(ConfigError, match=f"num_sms={num_sms!r}"):
        tiles_of("cuda", 2, 7168, 4096, 8, num_sms=num_sms)


def test_sm_cap_never_gives_a_grid_below_one():
    g = tiles_of("cuda", 2, 7168, 4096, 8, num_sms=1)
    assert min(g.grid_hist, g.grid_send, g.grid_expand, g.grid_partial, g.grid_out) >= 1


def test_no_module_reads_a_tritonep_variable_outside_envs():
    """docs/architecture.md: envs.py reads every TRITONEP_* variable (and its table lists it). The benchmark and
    test harnesses (bench/, testing/) set variables for the library and save / restore them: not counted."""
    import os
    import re

    import tritonep

    root = os.path.dirname(tritonep.__file__)
    read = re.compile(r"(environ\.get|getenv)\(\s*[\"'](TRITONEP_\w+)")
    offenders = []
    for d, _, files in os.walk(root):
        if os.path.relpath(d, root).split(os.sep)[0] in ("bench", "testing"):
            continue
        for f in files:
            if f.endswith(".py") and os.path.join(d, f) != os.path.join(root, "envs.py"):
                with open(os.path.join(d, f)) as fh:
                    offenders += [(f, m.group(2)) for m in read.finditer(fh.read())]
    assert not offenders, offenders
    with open(os.path.join(root, "envs.py")) as fh:
        src = fh.read()
    table = set(re.findall(r"^\| (TRITONEP_\w+) \|", src, re.M))
    assert set(re.findall(r"_get\(\"(TRITONEP_\w+)\"", src)) <= table


def test_force_no_p2p(monkeypatch):
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "1")
    assert envs.force_no_p2p() is True
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "0")
    assert envs.force_no_p2p() is False
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "yes")
    with pytest.raises(ConfigError, match="TRITONEP_FORCE_NO_P2P='yes'"):
        envs.force_no_p2p()

"""Every TRITONEP_* value and the ``num_sms`` argument are checked: a bad one is a ConfigError naming it, never a
bare ValueError, a silently ignored value or a negative kernel grid."""

import pytest

from tritonep import envs
from tritonep.errors import ConfigError
from tritonep.ep.geometry import select_geometry


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
        select_geometry("cuda", 2, 7168, 4096, 8, num_sms=num_sms)


def test_sm_cap_never_gives_a_grid_below_one():
    g = select_geometry("cuda", 2, 7168, 4096, 8, num_sms=1)
    assert min(g.grid_hist, g.grid_send, g.grid_expand, g.grid_partial, g.grid_out) >= 1

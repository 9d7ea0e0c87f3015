"""Importing tritonep has no side effects; kernels built for the wrong device are refused with a ConfigError."""

import os
import subprocess
import sys

import pytest

from tests import ROOT


def _py(code: str, env_extra: dict | None = None, drop=("TRITON_INTERPRET",)):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_import_sets_no_environment_and_no_kernels():
    r = _py("import os, sys\nbefore = dict(os.environ)\nimport tritonep as tep\n"
            "assert dict(os.environ) == before, 'import changed the environment'\n"
            "bad = [m for m in sys.modules if m.startswith(('tritonep.device', 'tritonep.runtime', 'tritonep.backends', 'tritonep.ep')) or '.kernels' in m]\n"
            "assert not bad, bad\n"
            "assert tep.EPBuffer.__name__ == 'EPBuffer' and tep.MoERecipe.__name__ == 'MoERecipe'\n"
            "assert 'TRITON_INTERPRET' not in os.environ\nprint('ok')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_unknown_attribute_is_attribute_error():
    import tritonep

    with pytest.raises(AttributeError, match="no_such_name"):
        tritonep.no_such_name  # noqa: B018


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
def test_cpu_buffer_with_compiled_kernels_is_a_config_error():
    r = _py("import tritonep as tep\nfrom tritonep.device.common import check_kernel_mode, kernels_interpreted\n"
            "assert not kernels_interpreted()\n"
            "try:\n    check_kernel_mode('cpu')\nexcept tep.ConfigError as e:\n    print('refused:', e)\n")
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "TRITON_INTERPRET=1" in r.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
def test_run_cpu_world_refuses_compiled_kernels():
    r = _py("import tritonep as tep\nimport tritonep.device.common\nfrom tritonep.testing import run_cpu_world\n"
            "try:\n    run_cpu_world(2, lambda g: 0)\nexcept tep.ConfigError as e:\n    print('refused:', e)\n")
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_cli_sets_interpreter_itself():
    r = _py("from tritonep.cli.main import main\nimport sys\nsys.exit(main(['plan', '--help']))")
    assert r.returncode == 0, r.stderr
    r = _py("import os\nfrom tritonep.cli.main import use_interpreter_without_gpu\nuse_interpreter_without_gpu()\n"
            "print(os.environ['TRITON_INTERPRET'])")
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr


_USER_BUFFER = ("import tempfile, torch.distributed as dist\nimport tritonep as tep\n"
                "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
                "try:\n    tep.EPBuffer(dist.group.WORLD, num_experts=4, hidden=64, max_tokens_per_rank=4, topk=2)\n"
                "except tep.errors.TritonEPError as e:\n    print(type(e).__name__ + ': ' + str(e))\n")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_cpu_epbuffer_outside_a_world_says_what_to_do():
    """What a new user tries first: ``import tritonep`` without TRITON_INTERPRET, then an EPBuffer on a CPU gloo
    group. One line, a ConfigError naming the variable and the CPU world (not a heap error or a Triton crash)."""
    r = _py(_USER_BUFFER)
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith("ConfigError: "), line
    assert "TRITON_INTERPRET=1" in line and "run_cpu_world" in line, line
    # with the interpreter on, the missing piece is the CPU world's shared heap, and the message says so
    r = _py(_USER_BUFFER, env_extra={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith("HeapError: ") and "run_cpu_world" in line, line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
def test_planner_and_wire_quantizers_with_compiled_kernels_are_config_errors():
    """Every public entry that launches a Triton kernel outside EPBuffer (the planner, the Triton quantizers)
    refuses CPU tensors with compiled kernels by a ConfigError, not Triton's "0 active drivers" RuntimeError."""
    r = _py("import torch\nimport tritonep as tep\nfrom tritonep.balance import plan\n"
            "from tritonep.wire.fp8 import quantize_fp8, dequantize_fp8\n"
            "from tritonep.wire.fp8_e5m2 import quantize_fp8_e5m2, dequantize_fp8_e5m2\n"
            "from tritonep.wire.mxfp4 import quantize_mxfp4, dequantize_mxfp4\n"
            "x = torch.ones(2, 128, dtype=torch.bfloat16)\n"
            "c = torch.ones(2, 4, dtype=torch.int32)\n"
            "calls = {'plan': lambda: plan(c, torch.zeros(2, 2, dtype=torch.long), 0),\n"
            "  'quantize_fp8': lambda: quantize_fp8(x),\n"
            "  'dequantize_fp8': lambda: dequantize_fp8(torch.zeros(2, 128, dtype=torch.uint8), torch.ones(2, 1)),\n"
            "  'quantize_fp8_e5m2': lambda: quantize_fp8_e5m2(x),\n"
            "  'dequantize_fp8_e5m2': lambda: dequantize_fp8_e5m2(torch.zeros(2, 128, dtype=torch.uint8),\n"
            "                                                      torch.ones(2, 1)),\n"
            "  'quantize_mxfp4': lambda: quantize_mxfp4(x),\n"
            "  'dequantize_mxfp4': lambda: dequantize_mxfp4(torch.zeros(2, 64, dtype=torch.uint8),\n"
            "                                                torch.full((2, 4), 127, dtype=torch.uint8))}\n"
            "for name, fn in calls.items():\n"
            "    try:\n        fn()\n        print(name, 'ran')\n"
            "    except tep.ConfigError as e:\n        assert 'TRITON_INTERPRET=1' in str(e), e\n"
            "        print(name, 'refused')\n"
            "    except Exception as e:\n        print(name, 'untyped', type(e).__name__, e)\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 7 and all(line.endswith(" refused") for line in lines), r.stdout

"""The CPU world (tritonep.testing.run_cpu_world): a rank that raises is named, a hung rank fails the world fast."""

import time

import pytest

from tritonep.errors import RankError
from tritonep.testing import WorldTimeout, run_cpu_world


def _raise_on_rank_1(group):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return 0


def _hang_on_rank_2(group):
    import torch.distributed as dist

    if dist.get_rank() == 2:
        time.sleep(600)
    return dist.get_rank()


def test_rank_exception_names_the_rank():
    t0 = time.time()
    with pytest.raises(RankError, match=r"rank 1 raised ValueError: boom on purpose"):
        run_cpu_world(3, _raise_on_rank_1, timeout_s=60)
    assert time.time() - t0 < 30


def test_hung_rank_fails_fast():
    t0 = time.time()
    with pytest.raises(WorldTimeout) as ei:
        run_cpu_world(3, _hang_on_rank_2, timeout_s=4)
    assert 2 in ei.value.ranks
    assert time.time() - t0 < 20


_KERNELS_FIRST = """
import sys
import tritonep as tep
from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
geo = tep.MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2, max_tokens_per_rank=16)  # imports kernels
heap = tep.EPBuffer.required_bytes(2, 8, 64, 16, 2) + (1 << 20)  # the README's sizing of a CPU world
try:
    print("ranks", run_cpu_world(2, lambda group: group.rank(), heap_bytes=heap))
except ConfigError as e:
    print("refused:", e)
"""


def _run_script(script: str, interpret, words):
    """Run ``script`` in a fresh Python (``TRITON_INTERPRET`` as ``interpret`` at start-up, unset when falsy): with it
    the script's world runs ("ranks [0, 1]"); without it the script prints the refusal, which names every one of
    ``words``."""
    import os
    import subprocess
    import sys

    from tests import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = interpret
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    if interpret:
        assert "ranks [0, 1]" in p.stdout, p.stdout + p.stderr
    else:
        msg = " ".join(p.stdout.split())
        assert msg.startswith("refused:"), p.stdout + p.stderr
        for w in words:
            assert w in msg, msg


@pytest.mark.parametrize("interpret", ["", "1"])
def test_kernels_imported_before_the_world_refused_unless_interpreted(interpret):
    """``MoEGeometry`` / ``EPBuffer.required_bytes`` in the parent import tritonep's kernels; without
    ``TRITON_INTERPRET=1`` at start-up they are compiled kernels, which the forked ranks cannot run: refused with a
    message naming those uses and the remedy (docs/integrations.md, "CPU worlds in your own scripts"). With it, the
    doc's ``heap_bytes=tep.EPBuffer.required_bytes(...) + (1 << 20)`` world runs."""
    _run_script(_KERNELS_FIRST, interpret, ("required_bytes", "MoEGeometry", "start Python with TRITON_INTERPRET=1",
                                            "inside the rank function"))


_IMPORT_FIRST = """
from tritonep.moe import RouterConfig  # a config class only, but importing tritonep.moe imports the kernels
from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
try:
    print("ranks", run_cpu_world(2, lambda group: group.rank()))
except ConfigError as e:
    print("refused:", e)
"""


def test_an_import_from_tritonep_moe_before_the_world_is_named_in_the_refusal():
    """A script that only imports ``RouterConfig`` at its top (as docs/moe.md's recipes suggest) is refused as well;
    the message names such imports and the in-script remedy (``os.environ['TRITON_INTERPRET'] = '1'`` first)."""
    import os
    import subprocess
    import sys

    from tests import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _IMPORT_FIRST], capture_output=True, text=True, timeout=300, env=env)
    msg = " ".join(p.stdout.split())
    assert p.returncode == 0 and msg.startswith("refused:"), p.stdout + p.stderr
    for words in ("tritonep.moe (RouterConfig too)", "tritonep.balance", "os.environ['TRITON_INTERPRET'] = '1'"):
        assert words in msg, msg


_TRITON_FIRST = """
import torch._dynamo  # imports triton.language, before anything sets TRITON_INTERPRET
from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
try:
    print("ranks", run_cpu_world(2, lambda group: group.rank()))
except ConfigError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("interpret", ["", "1"])
def test_triton_imported_for_the_gpu_before_the_world_is_refused(interpret):
    """``import torch._dynamo`` imports ``triton.language``; without ``TRITON_INTERPRET=1`` then, its library
    functions (``tl.sum``) are compiled ``JITFunction``s, which the ranks' interpreted kernels cannot call (a
    ``RuntimeError`` from inside the first kernel): refused before any rank starts, the message naming the import and
    the remedy. With the variable set at start-up the world runs."""
    _run_script(_TRITON_FIRST, interpret, ("triton.language", "torch._dynamo", "start Python with TRITON_INTERPRET=1"))

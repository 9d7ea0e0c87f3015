"""fp8 / mxfp4 wires on the nccl (torch.distributed) backend: bit-identical to the triton backend and to the twins.

Both backends run in the same CPU world (gloo + Triton interpreter) on the same inputs: dispatch rows (bf16 and
``keep_quantized`` payload / scales), counts, offsets, weights, combine output and the backward passes (always bf16)
must be equal. Independently, the nccl results must equal the twin quantizers of :mod:`tritonep.wire` applied to
:func:`tritonep.reference.dispatch_reference` rows, and, for combine, the twin applied to every rank's fp32 partial
(k ascending, products rounded first), dequantized to fp32 and summed over ranks ascending.
"""

import pytest
import torch

from tritonep.backends.nccl.backend import NcclEP
from tritonep.errors import WireError
from tritonep.testing import run_cpu_world
from tests.support.wire_checks import (CASE_TOKENS, CPU_CASE, GPU_CASE, both_backends_world,
                                         check_both_backends)

WIRES = [("fp8", "fp8"), ("mxfp4", "mxfp4"), ("fp8", "bf16")]


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_nccl_wires_match_triton_and_twins(dwire, cwire, W):
    ntok = CASE_TOKENS[W]
    res = run_cpu_world(W, both_backends_world, dwire, cwire, ntok, CPU_CASE, timeout_s=300)
    check_both_backends(res, dwire, cwire, ntok, CPU_CASE)


@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_nccl_wires_triton_sums_match_triton_and_twins(dwire, cwire):
    """The combine's Triton kernels (used on CUDA; interpreted here) give the same bits on every wire."""
    ntok = CASE_TOKENS[2]
    res = run_cpu_world(2, both_backends_world, dwire, cwire, ntok, CPU_CASE, True, timeout_s=300)
    check_both_backends(res, dwire, cwire, ntok, CPU_CASE)


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", ["", "pf=1"])
@pytest.mark.parametrize("dwire,cwire", WIRES)
def test_gpu_nccl_wires_match_triton_and_twins(gpu_world, monkeypatch, dwire, cwire, geometry):
    """``pf=1``: the expander's next-tile prefetch of the decoded rows, same bits."""
    if geometry:
        monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    ntok = [256, 200]
    res = gpu_world(2, both_backends_world, dwire, cwire, ntok, GPU_CASE, timeout_s=300, nccl=True)
    check_both_backends(res, dwire, cwire, ntok, GPU_CASE)


def test_unknown_wire_and_bad_hidden_raise_wire_error():
    from tritonep.ep.config import build_config

    def cfg(**kw):
        return build_config(world_size=2, num_experts=8, max_tokens_per_rank=4, topk=2, backend="nccl",
                            device_type="cpu", **{"hidden": 256, **kw})

    with pytest.raises(WireError, match="fp4"):
        cfg(dispatch_wire="fp4")
    with pytest.raises(WireError, match="combine_wire.*128"):
        cfg(hidden=96, combine_wire="fp8")
    for wire in ("fp8", "mxfp4"):  # accepted now
        ep = NcclEP(cfg(dispatch_wire=wire, combine_wire=wire), group=None, rank=0, device=torch.device("cpu"))
        assert (ep.cfg.dispatch_wire, ep.cfg.combine_wire, ep._dfmt.name) == (wire, wire, wire)
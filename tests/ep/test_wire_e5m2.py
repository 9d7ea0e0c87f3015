"""The fp8_e5m2 wire end to end: dispatch and combine on both backends in a CPU world, bit for bit.

It is the proof that a wire format is one registry record + its twin + its codec: nothing in the backends, the
kernels or the CLI names it. Both backends run in the same CPU world (rank body
:func:`tests.support.wire_checks.both_backends_world`: dispatch, combine, backward, ``keep_quantized``
dispatch and a combine after it) and must agree on every output; the nccl results must equal the record's twins
applied to :func:`tritonep.reference.dispatch_reference` rows (dispatch) and to every rank's fp32 partial
(combine: k ascending, dequantized to fp32, summed over ranks ascending). The fused (one-launch) dispatch /
combine kernels run the same checks, every recorded launch compiles for sm_90, and ``tritonep run`` accepts the
wire and passes its check.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.compile_check import compile_recorded, record_launches
from tests.support.wire_checks import (CASE_TOKENS, CPU_CASE, GPU_CASE, both_backends_world,
                                         check_both_backends)


@pytest.mark.parametrize("W,dwire,cwire", [(2, "fp8_e5m2", "fp8_e5m2"), (3, "fp8_e5m2", "fp8_e5m2"),
                                           (2, "fp8_e5m2", "bf16"), (2, "mxfp4", "fp8_e5m2")])
def test_e5m2_both_backends_match_twins(W, dwire, cwire):
    ntok = CASE_TOKENS[W]
    res = run_cpu_world(W, both_backends_world, dwire, cwire, ntok, CPU_CASE, timeout_s=300)
    check_both_backends(res, dwire, cwire, ntok, CPU_CASE)


def test_e5m2_fused_kernels_match_twins(monkeypatch):
    """The one-launch dispatch and push combine (triton backend) with the e5m2 wire, same bits."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=1,fe=1,fc=1")
    ntok = CASE_TOKENS[2]
    res = run_cpu_world(2, both_backends_world, "fp8_e5m2", "fp8_e5m2", ntok, CPU_CASE, timeout_s=300)
    check_both_backends(res, "fp8_e5m2", "fp8_e5m2", ntok, CPU_CASE)


@pytest.mark.gpu
def test_gpu_e5m2_both_backends_match_twins(gpu_world):
    ntok = [256, 200]
    res = gpu_world(2, both_backends_world, "fp8_e5m2", "fp8_e5m2", ntok, GPU_CASE, timeout_s=300, nccl=True)
    check_both_backends(res, "fp8_e5m2", "fp8_e5m2", ntok, GPU_CASE)


def _e5m2_paths(group):
    rank = dist.get_rank()
    recs = []
    with record_launches(recs):
        for geo in ("", "fs=1,fe=1,fc=1"):  # two kernels, then the fused (one-launch) dispatch and combine
            os.environ["TRITONEP_GEOMETRY"] = geo
            b = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire="fp8_e5m2", combine_wire="fp8_e5m2",
                             expert_alignment=4)
            x, idx, w = make_rank_inputs(rank, 9, 128, 8, 2, seed=5)
            d = b.dispatch(x, idx, w)
            b.combine(d.x, d.handle)
            b.dispatch(x, idx, w, keep_quantized=True)
            b.close()
        os.environ.pop("TRITONEP_GEOMETRY")
        from tritonep.wire import quantize_fp8_e5m2

        quantize_fp8_e5m2(torch.randn(4, 256))
    return recs


@pytest.mark.compile
def test_e5m2_kernels_compile_for_sm90():
    recs = run_cpu_world(2, _e5m2_paths, timeout_s=180)[0]
    assert {"dispatch_send_kernel", "dispatch_expand_kernel", "dispatch_fused_kernel", "combine_partial_kernel",
            "combine_out_kernel", "combine_fused_kernel", "fp8_quant_kernel"} <= {r.get("name") for r in recs}
    assert any((r.get("constexprs", {}).get("WIRE") or {}).get("wire_codec") == "fp8_e5m2" for r in recs)
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_cli_run_with_e5m2_wires_passes_its_check():
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "run", "--dispatch-wire", "fp8_e5m2",
                        "--combine-wire", "fp8_e5m2", "--world-size", "2", "--layers", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "all checks passed" in out and "tolerance 0.3" in out, out
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "run", "--hidden", "64", "--dispatch-wire",
                        "fp8_e5m2", "--layers", "2"], capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "--dispatch-wire fp8_e5m2" in out and "128" in out and "Traceback" not in out, out

"""The fp8_e5m2 wire end to end: dispatch and combine on both backends in a CPU world, bit for bit.

It is the proof that a wire format is one registry record + its twin + its codec: nothing in the backends, the
kernels or the CLI names it. Both backends run in the same CPU world (rank body :func:`test_nccl_wires._both`:
dispatch, combine, backward, ``keep_quantized`` dispatch and a combine after it) and must agree on every output;
the nccl results must equal the record's twins applied to :func:`tritonep.reference.dispatch_reference` rows
(dispatch) and to every rank's fp32 partial (combine: k ascending, dequantized to fp32, summed over ranks
ascending). The fused (one-launch) dispatch / combine kernels run the same checks, every recorded launch compiles
for sm_90, and ``tritonep run`` accepts the wire and passes its check.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tests.ep.nccl.test_wires import CPU, GPU, TOKENS, _both, _inputs
from tritonep.reference import dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.testing.compile_check import compile_recorded, record_launches
from tritonep.wire import get_wire

U8 = torch.uint8


def _qdq(wire, x, dtype):
    """Twin round trip of ``x`` on ``wire`` (bf16: RNE to bf16) -> ``dtype``; also the twin's (payload, scales)."""
    f = get_wire(wire)
    if not f.quantized:
        return x.to(torch.bfloat16).to(dtype), None
    q, s = f.quantize_torch(x)
    return f.dequantize_torch(q, s, dtype), (q.view(U8), s)


def _combine_want(W, ref, eos, cwire, r, T, H, K):
    """y of source rank r: per expert rank d ascending, fp32 partial (k ascending) -> wire -> fp32, summed."""
    y = torch.zeros(T, H)
    for d in range(W):
        part, has = torch.zeros(T, H), torch.zeros(T, dtype=torch.bool)
        for k in range(K):
            m = (ref[d].src_rank == r) & (ref[d].src_k == k)
            tok = ref[d].src_token[m].long()
            part[tok] = part[tok] + ref[d].weights[m][:, None] * eos[d][m].float()
            has[tok] = True
        y[has] = y[has] + _qdq(cwire, part, torch.float32)[0][has]
    return y.to(torch.bfloat16)


def _check(res, dwire, cwire, ntok, cfg):
    W = len(ntok)
    ins = [_inputs(r, ntok[r], cfg) for r in range(W)]
    ref = dispatch_reference([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], cfg["E"], W,
                             expert_alignment=cfg["A"])
    f = get_wire(dwire)
    for r in range(W):
        t, n = res[r]["triton"], res[r]["nccl"]
        for key in ("x", "ntpe", "offs", "weights", "y", "gx", "geo", "q", "s", "qntpe", "qoffs", "qweights", "yq"):
            assert t[key].dtype == n[key].dtype and torch.equal(t[key], n[key]), f"rank {r}: {key} differs"
        tol = 1e-5 * cfg["H"] / 256  # fp32 dot products over H: tile order on triton
        torch.testing.assert_close(t["gw"], n["gw"], rtol=tol, atol=tol)
        deq, (q, s) = _qdq(dwire, ref[r].x, torch.bfloat16)
        assert torch.equal(n["x"], deq), f"rank {r}: dispatch rows differ from the twins"
        assert torch.equal(n["q"], q) and torch.equal(n["s"], s), f"rank {r}: payload / scales differ"
        pad = ref[r].src_rank < 0
        zq, zs = f.empty_quantized(int(pad.sum()), cfg["H"], "cpu")
        assert torch.equal(n["q"][pad], zq) and torch.equal(n["s"][pad], zs), "padding rows: a zero row's encoding"
        for key, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                          ("weights", ref[r].weights), ("qoffs", ref[r].expert_offsets)):
            assert torch.equal(n[key], want), f"rank {r}: {key}"
    eos = [res[d]["nccl"]["eo"] for d in range(W)]
    for r in range(W):
        want = _combine_want(W, ref, eos, cwire, r, ntok[r], cfg["H"], cfg["K"])
        assert torch.equal(res[r]["nccl"]["y"], want), f"rank {r}: combine differs from the twins"
        assert torch.equal(res[r]["nccl"]["yq"], want)


@pytest.mark.parametrize("W,dwire,cwire", [(2, "fp8_e5m2", "fp8_e5m2"), (3, "fp8_e5m2", "fp8_e5m2"),
                                           (2, "fp8_e5m2", "bf16"), (2, "mxfp4", "fp8_e5m2")])
def test_e5m2_both_backends_match_twins(W, dwire, cwire):
    ntok = TOKENS[W]
    _check(run_cpu_world(W, _both, dwire, cwire, ntok, CPU, timeout_s=300), dwire, cwire, ntok, CPU)


def test_e5m2_fused_kernels_match_twins(monkeypatch):
    """The one-launch dispatch and push combine (triton backend) with the e5m2 wire, same bits."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=1,fe=1,fc=1")
    ntok = TOKENS[2]
    _check(run_cpu_world(2, _both, "fp8_e5m2", "fp8_e5m2", ntok, CPU, timeout_s=300), "fp8_e5m2", "fp8_e5m2",
           ntok, CPU)


@pytest.mark.gpu
def test_gpu_e5m2_both_backends_match_twins(gpu_world):
    ntok = [256, 200]
    _check(gpu_world(2, _both, "fp8_e5m2", "fp8_e5m2", ntok, GPU, timeout_s=300, nccl=True), "fp8_e5m2", "fp8_e5m2",
           ntok, GPU)


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


def test_e5m2_kernels_compile_for_sm90():
    recs = run_cpu_world(2, _e5m2_paths, timeout_s=180)[0]
    assert {"dispatch_send_kernel", "dispatch_expand_kernel", "dispatch_fused_kernel", "combine_partial_kernel",
            "combine_out_kernel", "combine_fused_kernel", "fp8_quant_kernel"} <= {r.get("name") for r in recs}
    assert any(r.get("constexprs", {}).get("WIRE") == {"wire_codec": "fp8_e5m2"} for r in recs)
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


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
    assert p.returncode == 2 and "dispatch_wire='fp8_e5m2'" in out and "Traceback" not in out, out

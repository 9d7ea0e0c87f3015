"""benchmarks/probes/sass_stats.py's SASS parsing: instruction counts by class from a ``cuobjdump -sass`` listing
(predicated instructions counted by their mnemonic, headers and encodings ignored), on a fixed listing, and the
probe's own run on a small profile with the sm_90 compile (slow)."""

import os
import subprocess
import sys

import pytest

from tests import ROOT, load_script


def _probe():
    return load_script("benchmarks/probes/sass_stats.py")


LISTING = """
        Function : dispatch_send_kernel
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/               @P0 LDS.U8 R3, [R2] ;                      /* 0x0000000002038984 */
        /*0030*/                   STS.128 [R4], R8 ;                     /* 0x0000000804007388 */
        /*0040*/                   SHFL.BFLY PT, R5, R6, 0x1, 0x1f ;      /* 0x0c201f0006057f89 */
        /*0050*/                   LOP3.LUT R7, R7, 0xf, RZ, 0xc0, !PT ;  /* 0x0000000f07077812 */
        /*0060*/              @!P1 STG.E.U8 desc[UR4][R2.64], R7 ;       /* 0x0000000702009986 */
        /*0070*/                   STL [R1], R9 ;                         /* 0x0000000901007387 */
        /*0080*/                   F2FP.BF16.F32.PACK_AB R4, R5, R6 ;     /* 0x000000060504723e */
        /*0090*/                   UIADD3 UR4, UR4, 0x1, URZ ;            /* 0x0000000104047890 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_sass_counts_by_class():
    total, classes, ops = _probe().sass_counts(LISTING)
    assert total == 11
    assert classes == {"ldg": 1, "move": 1, "shared": 2, "shfl": 1, "int": 1, "stg": 1, "local": 1, "cvt": 1,
                        "uniform": 1, "ctrl": 1}, classes
    assert ops["LDS"] == 1 and ops["STS"] == 1 and ops["F2FP"] == 1


@pytest.mark.slow
@pytest.mark.compile
def test_probe_runs_on_a_small_profile():
    """The probe end to end at the CPU-smoke shape: every recorded send / expand variant compiles for sm_90 and
    reports registers and an instruction count."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "benchmarks/probes/sass_stats.py", "--wires", "mxfp4", "--profile",
                        "cpu-smoke", "--combine", "--geometry", "cwarps=2"], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("mxfp4.")]
    assert {r.split()[1] for r in rows} == {"send_kernel", "expand_kernel", "combine_partial_kernel",
                                            "combine_out_kernel"}, p.stdout
    # --geometry reached the combine's launches: 2 warps a program, so 2 elements of a tile per thread (the CPU
    # table's 4 warps: 1)
    assert all(r.split()[-1] == "2" for r in rows if r.split()[1].startswith("combine")), p.stdout


@pytest.mark.slow
@pytest.mark.compile
def test_probe_counts_mode_compiles_each_variant():
    """``--counts``: the chunk histogram and counts exchange of the CPU-smoke shape per tile variant compile for
    sm_90; ``xeb=2`` reaches the exchange (a narrower expert block than the table's, every one of the shape's 8
    experts: fewer instructions)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "benchmarks/probes/sass_stats.py", "--wires", "bf16", "--profile",
                        "cpu-smoke", "--counts", "", "xeb=2"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {tuple(r.split()[:2]): r.split() for r in p.stdout.splitlines() if r.startswith("bf16.")}
    assert set(rows) >= {("bf16.table", "chunk_hist_kernel"), ("bf16.table", "exchange_kernel"),
                         ("bf16.xeb=2", "exchange_kernel")}, p.stdout
    total = 7  # the column of the instruction count (variant, kernel, regs, spill st/ld, local, smem, total)
    assert (int(rows[("bf16.xeb=2", "exchange_kernel")][total]) != int(rows[("bf16.table", "exchange_kernel")][total])
            ), p.stdout

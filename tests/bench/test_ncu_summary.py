"""benchmarks/probes/ncu_summary.py: Nsight Compute's text report of the kernel breakdown, one row per launch."""

from tests import load_script

# two launches as ncu prints them (trimmed: the sections' other lines do not matter to the parser)
REPORT = """==PROF== Profiling "dispatch_expand_kernel": 0%....50%....100% - 18 passes
  dispatch_expand_kernel (132, 1, 1)x(512, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Memory Throughput                 %        72.20
    DRAM Throughput                   %        72.20
    Duration                         us       215.01
    Section: Memory Workload Analysis
    Local Memory Spilling Requests                          218,496
    Local Memory Spilling Request Overhead           %      no data
    Memory Throughput                          Tbyte/s         2.42
    L2 Hit Rate                                      %        88.25
    OPT   Est. Speedup: 27.8%
          On average, each warp of this workload spends 18.2 cycles being stalled waiting for a scoreboard dependency
          on a L1TEX (local, global, surface, texture) operation. Find the instruction producing the data being waited
    Registers Per Thread             register/thread             128
    Achieved Occupancy                        %        24.95
  combine_partial_kernel (132, 1, 1)x(1024, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us       211.52
    Registers Per Thread             register/thread              64
"""


def test_parse_rows_and_labels():
    ns = load_script("benchmarks/probes/ncu_summary.py", "_ncu_summary")
    rows = ns.parse(REPORT, ["fp8"], extra=True)
    assert [r["kernel"] for r in rows] == ["dispatch_expand_kernel", "combine_partial_kernel"]
    a, b = rows
    assert (a["grid"], a["block"], a["duration_us"], a["dram_pct"], a["mem_tbps"]) == (132, 512, 215.01, 72.2, 2.42)
    assert (a["spill_requests"], a["regs"], a["occupancy_pct"], a["stall_l1tex_cycles"]) == (218496, 128, 24.95, 18.2)
    assert (a["label"], b["label"]) == ("fp8 dispatch warm-up", "fp8 combine warm-up")
    assert (b["block"], b["regs"], b["duration_us"]) == (1024, 64, 211.52) and "spill_requests" not in b
    # a launch order other than kernel_breakdown's is labelled '?', not mislabelled
    assert [r["label"] for r in ns.parse(REPORT.replace("dispatch_expand_kernel (", "combine_out_kernel ("),
                                         ["fp8"])] == ["?", "fp8 combine warm-up"]


def test_launch_labels_follow_the_breakdown_calls():
    ns = load_script("benchmarks/probes/ncu_summary.py", "_ncu_summary")
    fp8 = ns.launch_labels(["fp8"], extra=True)
    assert len(fp8) == 12 and fp8[-2:] == [("dispatch_expand_kernel", "fp8 dispatch.kept"),
                                           ("dispatch_expand_kernel", "fp8 dispatch.kept check")]
    bf16 = ns.launch_labels(["bf16"], extra=True)
    assert len(bf16) == 13 and bf16[10][1] == "bf16 combine_backward"
    assert len(ns.launch_labels(["fp8", "bf16"], extra=False)) == 20


# ncu scales a metric's unit to its value: a kernel that moves little prints its memory rate in Gbyte/s, a long one
# its duration in ms, a small dynamic shared memory in byte/block; its rule text wraps where the line is full
SCALED = """  combine_out_kernel (132, 1, 1)x(1024, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Memory Throughput                 %         0.06
    Duration                         ms         1.25
    Memory Throughput                          Gbyte/s         2.05
    Dynamic Shared Memory Per Block          byte/block          512
          On average, each warp of this workload spends 118.25 cycles being stalled waiting for a scoreboard
          dependency on a L1TEX (local, global, surface, texture) operation.
  combine_out_kernel (132, 1, 1)x(1024, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                    nsecond       850
    Memory Throughput                          Mbyte/s       463.88
"""


def test_parse_scales_units_to_the_rows():
    ns = load_script("benchmarks/probes/ncu_summary.py", "_ncu_summary")
    a, b = ns.parse(SCALED)
    assert a["duration_us"] == 1250.0 and a["mem_tbps"] == 0.00205 and a["dyn_smem_kb"] == 0.512
    assert a["stall_l1tex_cycles"] == 118.25
    assert b["duration_us"] == 0.85 and b["mem_tbps"] == 0.000464
    # the percent line of the same name is not read as a rate; a unit of another kind is no value at all
    assert "dram_pct" not in a
    assert ns.parse(SCALED.replace("Gbyte/s", "Gbyte/block"))[0].get("mem_tbps") is None

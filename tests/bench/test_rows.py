"""The benchmark's ratio summary on synthetic rows (the GPU rows themselves are made on the device)."""

from tritonep.bench.ep import ratio_lines


def _row(op, us, mode="graph", profile="decode"):
    return dict(profile=profile, op=op, us=us, mode=mode)


def test_ratio_lines():
    rows = [_row("tritonep.dispatch.bf16", 40.0), _row("tritonep.dispatch.bf16", 100.0, "eager"),
            _row("tritonep.combine.push.bf16", 25.0), _row("tritonep.combine.push.bf16", 50.0, "eager"),
            _row("tritonep[nccl].dispatch.bf16", 120.0, "eager"), _row("nccl.pipeline.dispatch", 150.0, "eager"),
            _row("tritonep[nccl].combine.bf16", 300.0, "eager"), _row("nccl.pipeline.combine", 600.0, "eager"),
            _row("tritonep.dispatch.bf16", 400.0, profile="deepseek-v3")]
    lines = ratio_lines(rows)
    assert lines == ["decode: dispatch eager/graph 2.50x (100/40 us); combine eager/graph 2.00x (50/25 us); "
                     "nccl-backend/pipeline dispatch 0.80x (120/150 us); nccl-backend/pipeline combine 0.50x "
                     "(300/600 us)"]


def test_ratio_lines_sync_free_modes():
    rows = [_row("nccl.pipeline.dispatch", 127.0, "eager"),
            _row("tritonep[nccl].dispatch_sync_free_onehop.bf16", 100.0, "eager"),
            _row("tritonep[nccl].dispatch_sync_free_gather.bf16", 190.5, "eager")]
    assert ratio_lines(rows) == ["decode: nccl-backend sync-free onehop/pipeline dispatch 0.79x (100/127 us); "
                                 "nccl-backend sync-free gather/pipeline dispatch 1.50x (190/127 us)"]

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


def test_world1_rows_against_their_byte_floor():
    from tritonep.bench.ep import floor_us

    T, H, R, pc = 4096, 7168, 32768, 1500.0  # DeepSeek-V3 at world 1; a copy of 1500 GB/s moves 3 TB/s
    base = dict(profile="deepseek-v3", world_size=1, tokens=T, hidden=H, recv_rows=R, mode="graph",
                peer_copy_gbps=pc)
    rows = [dict(base, op="tritonep.dispatch.bf16", us=238.0, variant="bt=8"),
            dict(base, op="tritonep.combine.push.bf16", us=230.0, variant="bt=8"),
            dict(base, op="tritonep.dispatch.fp8.kept", us=196.0, variant="bt=8")]
    bf16 = (T * H * 2 + R * H * 2) / (2 * pc * 1e3)  # 176 us
    assert abs(floor_us(rows[0]) - bf16) < 1e-9 and abs(floor_us(rows[1]) - bf16) < 1e-9
    fp8 = (T * H * 2 + R * (H + H // 128 * 4)) / (2 * pc * 1e3)  # payload + one fp32 scale per 128
    assert abs(floor_us(rows[2]) - fp8) < 1e-9
    assert floor_us(dict(rows[0], world_size=2)) is None and floor_us(dict(rows[0], mode="eager")) is None
    assert floor_us(dict(rows[0], op="nccl.pipeline.dispatch")) is None
    lines = ratio_lines(rows)
    assert "deepseek-v3 tritonep.dispatch.bf16 [bt=8]: 238 us = 1.35x its byte floor (176 us)" in lines
    assert "deepseek-v3 tritonep.dispatch.fp8.kept [bt=8]: 0.82x the bf16 dispatch (196 / 238 us)" in lines

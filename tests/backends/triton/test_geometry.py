"""The triton backend's launch geometry (tritonep.backends.triton.tiles): the table's choices, TRITONEP_GEOMETRY overrides
and their refusals, and that every tile / grid / role split gives the same bits."""

import pytest

from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
from tests.support.harness import calls_world, check_calls, make_calls


@pytest.mark.parametrize("W,geometry", [(2, "bt=1,bh=32,grid=5"), (2, "bt=2,grid=3,combine=pull"),
                                        (2, "bt=2,fs=2,fe=3,fc=1"), (2, "fs=3,fe=1"), (2, "bt=4,dec=3"),
                                        # combine tile != dispatch tile; grids that are multiples of W rotate each
                                        # program's partial sources (kernels.combine.partial_item_source)
                                        (2, "bt=4,cbt=1,cwarps=2,grid=4,pf=1,bh=32"), (2, "bt=1,cbt=4,fs=2,fe=2,fc=1,pf=1"),
                                        (3, "bt=2,cbt=1,grid=6,combine=pull")])
def test_geometry_override_small_tiles(monkeypatch, W, geometry):
    """The GPU decode geometry uses tiny token tiles and many programs, the fused paths split the grid by role;
    every tile/grid/role choice gives the same bits (2 calls: the fused and two-kernel paths follow each other)."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    cfg = dict(E=4 * W, H=96, Tmax=16, K=3, A=2, kind=None, repeat=True)
    calls = make_calls(W, cfg, [11, 5, 9][:W], seeds=[3, 4])
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=240)
    check_calls(cfg, calls, res, fp32=True)


def test_geometry_override_errors(monkeypatch):
    from tests.support.tiles import tiles_of

    monkeypatch.delenv("TRITONEP_GEOMETRY", raising=False)
    g = tiles_of("cuda", 2, 7168, 4096, 8)  # the table: fused dispatch at >= 1024 tokens, no SM cap
    assert (g.fused_send, g.fused_expand, g.grid_send, g.grid_expand, g.fused_combine) == (40, 88, 40, 88, False)
    assert tiles_of("cuda", 1, 7168, 4096, 8).fused_send == 0  # world 1: no transfer to overlap
    assert tiles_of("cuda", 1, 7168, 1024, 8).fused_send == 40  # ... but host-bound eager calls at 1024
    g = tiles_of("cuda", 2, 7168, 4096, 8, num_sms=24)  # capped: two kernels
    assert (g.fused_send, g.grid_send) == (0, 24)
    assert tiles_of("cuda", 2, 7168, 128, 8).fused_send == 0  # decode: two kernels
    for wire in ("fp8", "mxfp4", "fp8_e5m2"):  # quantizing senders need the whole grid: two kernels (measured)
        g = tiles_of("cuda", 2, 7168, 4096, 8, wire=wire)
        assert (g.fused_send, g.grid_send, g.grid_expand) == (0, 132, 132), wire
    g = tiles_of("cuda", 2, 7168, 4096, 8)  # the combine's own tile: 8 tokens x 32 warps (measured)
    assert (g.bt, g.cbt, g.num_warps, g.cwarps) == (16, 8, 8, 32)
    g = tiles_of("cuda", 2, 7168, 4096, 8, wire="fp8", num_sms=24)  # capped fp8: 16 warps + prefetch
    assert (g.num_warps, g.prefetch, g.cwarps) == (16, True, 32)
    assert not tiles_of("cuda", 2, 7168, 4096, 8, num_sms=24).prefetch
    for W in (1, 2):  # quantizing tiles: 16 warps, no prefetch without a cap (measured, H100 world 1)
        for wire in ("fp8", "mxfp4"):
            g = tiles_of("cuda", W, 7168, 4096, 8, wire=wire)
            # mxfp4: 8-token tiles, where its expander (encoder and decoder) compiles without spills (measured)
            assert (g.num_warps, g.prefetch, g.bt) == (16, False, 8 if wire == "mxfp4" else 16), (W, wire)
    assert tiles_of("cuda", 2, 7168, 128, 8, wire="fp8").num_warps == 4  # small batches keep theirs
    g = tiles_of("cuda", 1, 7168, 4096, 8)  # world-1 bf16 expand: 8-token tiles (measured)
    assert (g.bt, g.num_warps, g.bbt, g.bwarps) == (8, 8, 8, 32)
    assert tiles_of("cuda", 1, 7168, 2048, 8).bt == 16 and tiles_of("cuda", 1, 7168, 4096, 8, num_sms=24).bt == 16
    g = tiles_of("cuda", 2, 7168, 128, 8)  # decode: the dispatch's tiny tile
    assert (g.cbt, g.cwarps) == (g.bt, g.num_warps)
    assert tiles_of("cpu", 2, 96, 16, 3).cbt == tiles_of("cpu", 2, 96, 16, 3).bt
    monkeypatch.setenv("TRITONEP_GEOMETRY", "cbt=8,cwarps=16")
    g = tiles_of("cuda", 2, 7168, 4096, 8)
    assert (g.bt, g.cbt, g.num_warps, g.cwarps) == (16, 8, 8, 16)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "cbt=2")
    assert (tiles_of("cuda", 2, 7168, 4096, 8).cbt, tiles_of("cuda", 2, 7168, 4096, 8).cwarps) == (2, 32)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=0,fe=0")
    assert tiles_of("cuda", 2, 7168, 4096, 8).fused_send == 0
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bt=4,warps=8,grid=7")
    g = tiles_of("cuda", 2, 7168, 4096, 8)
    assert (g.bt, g.num_warps, g.grid_send, g.grid_out) == (4, 8, 7, 7)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=40,fe=88")
    g = tiles_of("cuda", 2, 7168, 4096, 8)
    assert (g.grid_send, g.grid_expand, g.grid_partial, g.fused_combine) == (40, 88, 132, False)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=40,fe=88,fc=1")
    g = tiles_of("cuda", 2, 7168, 4096, 8, num_sms=24)  # the cap keeps the role split
    assert (g.fused_send, g.fused_expand, g.grid_send, g.grid_out) == (7, 17, 7, 17)
    for bad, what in (("bq=2", "unknown field"), ("bt=3", "power of two"), ("grid=0", "grid"),
                      ("combine=both", "push or pull"), ("bh=x", "not an integer"), ("fs=4", "both"),
                      ("fc=1", "needs fs.*e.g. fs=40,fe=88,fc=1"), ("fs=2,fe=2,fc=2", "0 or 1"),
                      ("cbt=3", "power of two"),
                      ("cwarps=0", "power of two")):
        monkeypatch.setenv("TRITONEP_GEOMETRY", bad)
        with pytest.raises(ConfigError, match=what):
            tiles_of("cuda", 2, 7168, 128, 8)  # a shape whose table geometry is the two-kernel path
    monkeypatch.setenv("TRITONEP_GEOMETRY", "grid=128,fc=1")  # grid= turns the fused roles off: fc=1 is refused,
    with pytest.raises(ConfigError, match="fc=1 needs fs"):  # not silently dropped
        tiles_of("cuda", 2, 7168, 4096, 8)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fc=1")  # world 1 from 4096 tokens: two kernels, the error says what to add
    with pytest.raises(ConfigError, match="e.g. fs=40,fe=88,fc=1"):
        tiles_of("cuda", 1, 7168, 4096, 8)


def test_backward_expand_tile(monkeypatch):
    """The combine backward's expand has its own tile (KernelTiles.bbt / bwarps, chosen spill-free by ptxas -v,
    tests/backends/test_compile_sm90.py): 8 tokens x 32 warps under the dispatch's 16-token tile, the decode tiles
    kept; the CPU and an override follow the dispatch's unless set. Its grid (bgrid) is every program of the
    forward dispatch (both fused roles), within the SM cap."""
    from tests.support.tiles import tiles_of

    monkeypatch.delenv("TRITONEP_GEOMETRY", raising=False)
    g = tiles_of("cuda", 2, 7168, 4096, 8)  # fused: both roles
    assert (g.bt, g.num_warps, g.bbt, g.bwarps, g.grid_expand, g.bgrid) == (16, 8, 8, 32, 88, 128)
    g = tiles_of("cuda", 1, 7168, 4096, 8)  # world 1: two kernels (8-token tiles), the expand's grid
    assert (g.bt, g.num_warps, g.bbt, g.bwarps, g.grid_expand, g.bgrid) == (8, 8, 8, 32, 132, 132)
    g = tiles_of("cuda", 1, 7168, 128, 8)
    assert (g.bt, g.num_warps, g.bbt, g.bwarps, g.grid_expand, g.bgrid) == (1, 4, 1, 4, 128, 128)
    g = tiles_of("cuda", 1, 7168, 4096, 8, num_sms=24)
    assert (g.grid_expand, g.bgrid) == (24, 24)
    # W2 at 128 tokens: the decode default's one-token tile (1 x 4); 256 tokens: two-token tiles (2 x 16)
    assert (tiles_of("cuda", 2, 7168, 128, 8).bbt, tiles_of("cuda", 2, 7168, 128, 8).bwarps) == (1, 4)
    assert (tiles_of("cuda", 2, 7168, 256, 8).bbt, tiles_of("cuda", 2, 7168, 256, 8).bwarps) == (2, 16)
    g = tiles_of("cpu", 2, 96, 16, 3)
    assert (g.bbt, g.bwarps, g.bgrid) == (g.bt, g.num_warps, g.grid_expand)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bbt=4,bwarps=16,bgrid=64")
    g = tiles_of("cuda", 1, 7168, 4096, 8)
    assert (g.bt, g.bbt, g.bwarps, g.bgrid, g.grid_expand) == (8, 4, 16, 64, 132)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bgrid=64")
    assert tiles_of("cuda", 1, 7168, 4096, 8, num_sms=24).bgrid == 24  # the cap clips it
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bt=4")
    assert tiles_of("cuda", 1, 7168, 4096, 8).bbt == 4  # the table's tile for the override's bt
    for bad, what in (("bbt=3", "power of two"), ("bwarps=0", "power of two"), ("bgrid=0", "bgrid must be")):
        monkeypatch.setenv("TRITONEP_GEOMETRY", bad)
        with pytest.raises(ConfigError, match=what):
            tiles_of("cuda", 1, 7168, 4096, 8)


@pytest.mark.parametrize("wire,block", [("fp8", 128), ("fp8_e5m2", 128), ("mxfp4", 32)])
def test_tile_narrower_than_a_quantized_wire_block_is_a_config_error(wire, block):
    """A ``bh`` override below a quantized wire's scale block (the codec encodes whole blocks of a tile) is refused
    when the buffer is configured, naming both, instead of failing inside the first call's kernels; the block itself
    is accepted."""
    from tritonep.ep.config import build_config

    kw = dict(world_size=1, num_experts=4, hidden=256, max_tokens_per_rank=8, topk=2, device_type="cpu")
    for field in ("dispatch_wire", "combine_wire"):
        with pytest.raises(ConfigError, match=rf"bh={block // 2}.*{field}={wire!r}.*{block}"):
            build_config(tiles=f"bh={block // 2}", **{field: wire}, **kw)
    assert build_config(tiles=f"bh={block}", dispatch_wire=wire, combine_wire=wire, **kw).tiles.bh == block

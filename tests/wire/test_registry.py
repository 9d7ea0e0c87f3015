"""The wire-format registry (tritonep.wire.formats) and the fp8_e5m2 wire it proves: records, twin, device codec.

* Every record is consistent (sizes, ids, codec, twins) and the sizes, the CLI and the benchmark read it.
* fp8_e5m2 twin == an independent reference (torch's own float8_e5m2 cast, in range) and its stated specials.
* The Triton codec (interpreted on CPU) == the twin bit for bit, and the round-trip error bound holds.
* For EVERY registered quantized wire, the generic row codec of the EP kernels (:mod:`tritonep.wire.kernels.wirecodec`:
  encode once, store, load/decode, raw copy) writes exactly ``twin payload | twin scale bytes`` per row and decodes
  exactly the twin's fp32 values: a new record is checked here without new code.
"""

import pytest
import torch
import triton
import triton.language as tl

from tritonep.errors import InputError, WireError
from tritonep.wire.kernels.wirecodec import DeviceCodec, wire_copy_raw, wire_load, wire_store
from tritonep.wire import (
    E5M2_ABS_ERR_SCALE,
    E5M2_MAX,
    E5M2_REL_ERR,
    WIRE_FORMATS,
    WIRES,
    check_wire,
    dequantize_fp8_e5m2,
    dequantize_fp8_e5m2_torch,
    e5m2_encode_torch,
    get_wire,
    num_scales,
    payload_bytes,
    quantize_fp8_e5m2,
    quantize_fp8_e5m2_torch,
    scale_bytes,
    scale_dtype,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U8 = torch.uint8
QUANTIZED = [n for n, f in WIRE_FORMATS.items() if f.quantized]


# ---------------------------------------------------------------------------------------------- registry
def test_codec_repr_names_every_field():
    """Triton's in-process kernel cache keys on the constexprs' reprs: codecs of one name that differ in a field
    (stage_own, a size) must have different reprs, or one would run the other's compiled kernel."""
    import dataclasses

    from triton.runtime.jit import compute_cache_key

    codec = get_wire("mxfp4").codec
    flipped = dataclasses.replace(codec, stage_own=not codec.stage_own)
    assert repr(codec) != repr(flipped) and repr(codec) == repr(dataclasses.replace(codec))
    assert repr(codec) == codec.cache_key
    assert compute_cache_key({}, [("constexpr", codec)], "o") != compute_cache_key({}, [("constexpr", flipped)], "o")
    fp8 = get_wire("fp8").codec
    assert repr(dataclasses.replace(fp8, block=2 * fp8.block)) != repr(fp8)


@pytest.mark.parametrize("wire", WIRES)
def test_every_codec_pickles_with_its_cache_key(wire):
    """A codec (the registry's, one with ``stage_own`` flipped, one with another block) goes through pickle (a
    spawned process's arguments, a cache on disk) and deepcopy as an equal codec with the same tile functions and
    ``cache_key``; one whose tile function is not a module's attribute is refused as pickle refuses it."""
    import copy
    import dataclasses
    import pickle

    codec = get_wire(wire).codec
    codecs = [codec]
    if codec.quantized:
        codecs += [dataclasses.replace(codec, stage_own=not codec.stage_own),
                   dataclasses.replace(codec, block=2 * codec.block)]
    for c in codecs:
        for back in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
            assert back == c and hash(back) == hash(c) and back.cache_key == c.cache_key, (c, back)
            assert back.encode is c.encode and back.decode is c.decode and back.stage_own == c.stage_own
    if codec.quantized:
        @triton.jit
        def local_tile(x, POW2: tl.constexpr, FAST: tl.constexpr):
            return x, x

        with pytest.raises((pickle.PicklingError, AttributeError), match="local"):  # by Python version
            pickle.dumps(dataclasses.replace(codec, encode=local_tile))


@triton.jit
def _stage_own_kernel(out_ptr, WIRE: tl.constexpr):
    tl.store(out_ptr, WIRE.stage_own)


def test_launch_records_tell_codecs_of_one_name_apart():
    """The launch recorders of the test tooling (``tests.support.compile_check``, ``tests.support.variant_keys``)
    record a codec by its name AND fields: two codecs of one name that differ in ``stage_own`` record different
    keys, and each record gives its own codec back (what an offline compile of the record compiles)."""
    import dataclasses

    from tests.support.compile_check import _const_from_json, _const_to_json, record_launches
    from tests.support.variant_keys import key_text, launch_key

    codec = get_wire("mxfp4").codec
    both = [codec, dataclasses.replace(codec, stage_own=not codec.stage_own)]
    out = torch.zeros(1, dtype=torch.int32, device=DEV)
    recs = []
    with record_launches(recs):
        for c in both:
            _stage_own_kernel[(1,)](out, WIRE=c)
            assert int(out[0]) == int(c.stage_own)
    wires = [r["constexprs"]["WIRE"] for r in recs if r.get("name") == "_stage_own_kernel"]
    assert len(wires) == 2 and wires[0] != wires[1] and [_const_from_json(w) for w in wires] == both, wires
    keys = [key_text(launch_key(_stage_own_kernel, (out,), dict(WIRE=c))) for c in both]
    assert keys[0] != keys[1]
    assert _const_from_json({"wire_codec": "mxfp4"}) == codec  # a record of the name alone: the registry's
    with pytest.raises(ValueError, match="tile functions"):
        _const_to_json(dataclasses.replace(codec, decode=get_wire("fp8").codec.decode))


def test_registry_records_are_consistent():
    assert WIRES[:3] == ("bf16", "fp8", "mxfp4") and "fp8_e5m2" in WIRES
    assert len({f.id for f in WIRE_FORMATS.values()}) == len(WIRES)
    assert [get_wire(w).id for w in ("bf16", "fp8", "mxfp4", "fp8_e5m2")] == [0, 1, 2, 3]  # kept stable
    for name, f in WIRE_FORMATS.items():
        assert f.name == name == f.codec.name and repr(f.codec).startswith(f"wire_{name}_")
        h = 7168
        assert f.row_bytes(h) == f.payload_bytes(h) + f.scale_bytes(h) <= 2 * h  # fits the staging rows
        assert f.scale_bytes(h) == f.num_scales(h) * f.codec.scale_bytes
        assert 0 < f.tolerance < 1
        if f.quantized:
            x = torch.randn(3, 256)
            q, s = f.quantize_torch(x)
            assert q.view(U8).shape == (3, f.payload_bytes(256)) and s.shape == (3, f.num_scales(256))
            assert q.dtype == f.payload_dtype and s.dtype == f.scale_dtype
            pq, ps = f.empty_quantized(2, 256, "cpu")
            zq, zs = f.quantize_torch(torch.zeros(2, 256))
            assert torch.equal(pq, zq.view(U8)) and torch.equal(ps, zs)  # padding rows = a zero row's encoding
    e = get_wire("fp8_e5m2")
    assert (e.block, e.payload_bytes(7168), e.num_scales(7168), e.scale_bytes(7168)) == (128, 7168, 56, 224)
    assert (payload_bytes("fp8_e5m2", 256), num_scales("fp8_e5m2", 256), scale_bytes("fp8_e5m2", 256)) == (256, 2, 8)
    assert scale_dtype("fp8_e5m2") == torch.float32 and e.max_value == E5M2_MAX == 57344.0
    with pytest.raises(WireError, match="dispatch_wire='e5m2'.*bf16, fp8, mxfp4, fp8_e5m2"):
        get_wire("e5m2", "dispatch_wire")
    with pytest.raises(WireError, match=r"combine_wire='fp8_e5m2'.*128.*hidden=96"):
        check_wire("fp8_e5m2", 96, field="combine_wire")
    with pytest.raises(ValueError, match="disagree"):
        type(e)("fp8_e5m2", 9, e.codec, 0.3, 1.0, torch.uint8, torch.uint8, e.quantize_torch, e.dequantize_torch)
    with pytest.raises(ValueError, match="fit"):
        DeviceCodec("big", block=2, payload_bits=8, scale_bytes=4, scale_dtype=tl.float32,
                    encode=e.codec.encode, decode=e.codec.decode)


def test_cli_and_bench_read_the_registry():
    import argparse

    from tritonep.cli import run

    assert run.TOL == {n: f.tolerance for n, f in WIRE_FORMATS.items()}
    p = argparse.ArgumentParser()
    run.add_parser(p.add_subparsers())
    a = p.parse_args(["run", "--dispatch-wire", "fp8_e5m2", "--combine-wire", "fp8_e5m2"])
    assert (a.dispatch_wire, a.combine_wire) == ("fp8_e5m2", "fp8_e5m2")
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--dispatch-wire", "fp8_e4m3"])


# ---------------------------------------------------------------------------------------------- e5m2 twin
def _finite_rows(n, h, dtype, seed, spread):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * torch.logspace(-spread, spread, n)[:, None]).to(dtype)


def test_e5m2_encode_twin_matches_torch_cast_and_specials():
    g = torch.Generator().manual_seed(5)
    y = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-7, 5, (4096,), generator=g),
                   torch.tensor([0.0, -0.0, 57344.0, -57344.0, 2.0**-14, 2.0**-16, 1.5 * 2**-16, 2.0**-17,
                                 2.0**-17 * 1.0001, 3 * 2.0**-17, 2.0**-126, 1e-45])])
    y = y[y.abs() <= E5M2_MAX]
    assert torch.equal(e5m2_encode_torch(y), y.to(torch.float8_e5m2).view(U8))  # in range: torch's RNE cast
    sp = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -60000.0, 61439.0])
    assert e5m2_encode_torch(sp).tolist() == [0x7F, 0x7B, 0xFB, 0x7B, 0xFB, 0x7B]  # satfinite
    with pytest.raises(InputError):
        e5m2_encode_torch(y.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_e5m2_triton_codec_matches_twin(dtype, pow2):
    spread = 4 if dtype == torch.float16 else 30
    x = _finite_rows(37, 384, dtype, seed=2, spread=spread)
    sp = torch.randn(6, 384, generator=torch.Generator().manual_seed(9))
    sp[0] = 0
    sp[1, 3], sp[2, 5], sp[2, 200] = float("nan"), float("inf"), -float("inf")
    sp[3] = torch.finfo(dtype).max * torch.sign(sp[3])
    sp[4] *= torch.finfo(dtype).smallest_normal
    sp[5, :128] = -0.0
    sp[5, 128:256] *= 3e-10  # e5m2 subnormals (the block's amax is ~1e-9 of the next block's)
    sp[5, 130] = 1.0
    x = torch.cat([x, sp.to(dtype)])
    q, s = quantize_fp8_e5m2_torch(x, pow2)
    q2, s2 = quantize_fp8_e5m2(x.to(DEV), pow2)
    assert q2.dtype == torch.float8_e5m2 and s2.shape == (x.shape[0], 3)
    assert torch.equal(q.view(U8), q2.cpu().view(U8)) and torch.equal(s, s2.cpu())
    for od in (torch.bfloat16, torch.float16, torch.float32):
        a, b = dequantize_fp8_e5m2_torch(q, s, od), dequantize_fp8_e5m2(q.to(DEV), s.to(DEV), od).cpu()
        na = torch.isnan(a)
        assert torch.equal(na, torch.isnan(b)) and torch.equal(a[~na], b[~na])


def test_e5m2_decode_every_code():
    q = torch.arange(256, dtype=U8).repeat(2).view(2, 256)  # every code, twice per block of 128
    s = torch.tensor([[1.0, 2.0**-20], [3.0, 0.5]])
    a, b = dequantize_fp8_e5m2_torch(q, s, torch.float32), dequantize_fp8_e5m2(q.to(DEV), s.to(DEV), torch.float32)
    na = torch.isnan(a)
    assert int(na.sum()) == 12 and torch.equal(na, torch.isnan(b.cpu())) and torch.equal(a[~na], b.cpu()[~na])


def test_e5m2_round_trip_error_bound():
    x = _finite_rows(64, 256, torch.float32, seed=3, spread=20)
    q, s = quantize_fp8_e5m2_torch(x)
    y = dequantize_fp8_e5m2_torch(q, s, torch.float32)
    scale = s.repeat_interleave(128, dim=1)
    bound = E5M2_REL_ERR * x.abs() + E5M2_ABS_ERR_SCALE * scale + 2.0**-21 * x.abs()
    assert bool(((y - x).abs() <= bound).all())
    assert float((q.view(U8) & 0x7F).max()) <= 0x7B  # never Inf/NaN codes for finite input


# ---------------------------------------------------------------------------------------------- row codec
@triton.jit
def _rows_kernel(x_ptr, rows_ptr, dec_ptr, q_ptr, s_ptr, N, H: tl.constexpr, RB: tl.constexpr, BT: tl.constexpr,
                 BH: tl.constexpr, WIRE: tl.constexpr):
    """Encode rows of ``x`` into wire rows of RB bytes (one pass per column tile), decode them, copy them raw."""
    t = tl.arange(0, BT)
    for r0 in range(0, N, BT):
        row = r0 + t
        ok = row < N
        off = row.to(tl.int64) * RB
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            m = ok[:, None] & (h < H)[None, :]
            x = tl.load(x_ptr + row[:, None].to(tl.int64) * H + h[None, :], mask=m, other=0.0)
            wire_store(rows_ptr, off, h0, x, ok, H, BH, BT, WIRE, False)
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            v = wire_load(rows_ptr, off, h0, ok, H, BH, BT, WIRE, False)
            tl.store(dec_ptr + row[:, None].to(tl.int64) * H + h[None, :], v,
                     mask=ok[:, None] & (h < H)[None, :])
            wire_copy_raw(rows_ptr, off, h0, ok, q_ptr, s_ptr, row, ok, H, BH, WIRE)


@pytest.mark.parametrize("wire", QUANTIZED)
def test_row_codec_layout_and_values_match_the_twin(wire):
    f = get_wire(wire)
    N, H, BT, BH = 5, 384, 4, 256  # a partial column tile and a partial row tile
    x = _finite_rows(N, H, torch.float32, seed=4, spread=8).to(DEV)
    x[1, :128] = 0
    RB = 2 * H
    rows = torch.full((N, RB), 0xAB, dtype=U8, device=DEV)
    dec = torch.empty(N, H, dtype=torch.float32, device=DEV)
    q, s = f.empty_quantized(N, H, DEV)
    _rows_kernel[(1,)](x, rows, dec, q, s, N, H=H, RB=RB, BT=BT, BH=BH, WIRE=f.codec)
    tq, ts = f.quantize_bytes(x.cpu())
    rb = f.row_bytes(H)
    assert torch.equal(rows[:, :rb].cpu(), torch.cat([tq, ts], 1)), "wire row = payload | scale bytes"
    assert bool((rows[:, rb:] == 0xAB).all()), "nothing written past row_bytes"
    assert torch.equal(dec.cpu(), f.dequantize_rows(rows.cpu(), H, torch.float32))
    assert torch.equal(q.cpu(), tq) and torch.equal(s.cpu().view(U8), ts)

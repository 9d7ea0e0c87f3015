"""The kernel tiles of the triton backend (tile sizes, grids, combine kind, fused / one-launch roles) from a small
static table, never autotuned at run time (:class:`KernelTiles`, :func:`select_tiles`). "Tiles" here, so that
"geometry" keeps one meaning: the model's shape (:class:`tritonep.MoEGeometry`).

Keyed by (device kind, world_size, hidden, token bucket, wire). The GPU choices were measured on the H200 with
``benchmarks/ep_bench.py``; docs/performance.md ("Why the defaults") gives the figures behind each. CPU rows keep
interpreter runs short (one program, big tiles).
Grids must be identical on every rank (receivers wait for ``calls * grid`` arrivals), so the choice depends only on
the static configuration, which EPBuffer checks is the same on every rank. :func:`select_tiles` reads no environment:
the configuration (:func:`tritonep.ep.config.build_config`) hands it the SM cap, the override (the ``tiles``
argument or TRITONEP_GEOMETRY), the forced combine kind and the program cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from ...wire.formats import get_wire

__all__ = ["KernelTiles", "select_tiles", "parse_tiles", "DECODE_MAX_TOKENS"]

# largest max_tokens_per_rank of the one-launch decode paths: their programs hold every route of the rank in one
# [next_pow2(Tmax), next_pow2(topk)] tile (2048 ids at top-8), histogrammed redundantly by every program
DECODE_MAX_TOKENS = 256


@dataclass(frozen=True)
class KernelTiles:
    """Tiles and grids of the triton backend's EP kernels (frozen; every rank's are equal).

    bt: tokens per tile; bh: hidden columns per tile; grid_*: programs of each kernel; num_warps; combine: "push"
    or "pull"; fused_send / fused_expand: when > 0, the forward dispatch runs as ONE launch of
    ``fused_send + fused_expand`` programs (:mod:`tritonep.backends.triton.kernels.dispatch_fused`), else send + expand kernels;
    fused_combine: the weighted push combine also runs as one launch with the same role sizes
    (:mod:`tritonep.backends.triton.kernels.combine_fused`). A fused path forces its two-kernel grids to the role sizes.
    decode: when > 0 (only for ``max_tokens_per_rank <= DECODE_MAX_TOKENS``), the forward dispatch and the weighted
    push combine each run as ONE launch of ``decode`` programs (:mod:`tritonep.backends.triton.kernels.decode_dispatch`,
    :mod:`tritonep.backends.triton.kernels.decode_combine`; counts exchange folded in); every two-kernel grid then equals
    ``decode`` (at most ``cdiv(max_tokens_per_rank, bt)``, 132 and the SM cap) and the fused paths are off.
    cbt / cwarps: token tile and warps of the combine kernels (partial, output, fused combine; 0 = ``bt`` /
    ``num_warps``): the combine gathers K expert rows per token, so its tile is sized by the K loads one thread
    keeps in flight, not by the dispatch's tile (:func:`select_tiles` resolves both to non-zero values).
    prefetch: the dispatch expander loads the next hidden tile of a source row before storing the current one.
    bbt / bwarps / bgrid: token tile, warps and grid of the combine backward's expand (0 = ``bt`` / ``num_warps`` /
    every program of the forward dispatch: ``fused_send + fused_expand`` when fused, else ``grid_expand``; its last
    program acknowledges the sources for ``grid_expand`` programs, so the grid is free): per route it loads an
    expert-output tile next to the source tile for the weight gradient, so its tile is sized so that no registers
    spill (:func:`select_tiles` resolves all three to non-zero values).
    grid_hist: programs of the chunk histogram. xeb: experts per tile of the counts exchange (0: the rule of
    :func:`tritonep.backends.triton.kernels.layout.exchange_tiles`); xwarps: warps of the chunk histogram and the
    counts exchange (0: ``num_warps``).
    """

    bt: int
    bh: int
    grid_hist: int
    grid_send: int
    grid_expand: int
    grid_partial: int
    grid_out: int
    num_warps: int
    combine: str
    fused_send: int = 0
    fused_expand: int = 0
    fused_combine: bool = False
    decode: int = 0
    cbt: int = 0
    cwarps: int = 0
    prefetch: bool = False
    bbt: int = 0
    bwarps: int = 0
    bgrid: int = 0
    xeb: int = 0
    xwarps: int = 0


_OVERRIDE_FIELDS = ("bt", "bh", "warps", "grid", "combine", "fs", "fe", "fc", "dec", "cbt", "cwarps", "pf", "bbt",
                    "bwarps", "bgrid", "hg", "xeb", "xw")

# the combine backward's expand tile on the GPU, by the dispatch's token tile: (bbt, bwarps). Chosen by ptxas -v at
# the DeepSeek-V3 shape (H 7168 -> BH 1024, top-8, bf16, alignment 16; tests.support.compile_check.ptxas_usage,
# sm_90a), registers / spill bytes stored / loaded: the dispatch's tile 16 tokens x 8 warps 255 / 2956 / 2592 (the
# K expert-output tiles of the weight gradient in flight at once; 32 / 8408 / 11388 with the in-kernel zeroing);
# 8 x 32 warps (8 columns per thread, one 16-byte load per route, the combine's tile) 62 / 0 / 0; 4 x 8 255 / 0;
# 2 x 16 117 / 0; 1 x 4 64 / 0 (8 x 16 spills 140 / 152, 4 x 16 20 / 28, 2 x 8 32 / 40). Not timed yet: the GPU
# picks by TRITONEP_GEOMETRY=bbt=..,bwarps=..,bgrid=.. (benchmarks/eager_profile.py combine_bwd_*);
# tests/backends/test_compile_sm90.py keeps the table spill-free.
_BWD_TILE = {16: (8, 32), 8: (8, 32), 4: (4, 8), 2: (2, 16), 1: (1, 4)}


def _apply_override(g: KernelTiles, text: str, source: str = "TRITONEP_GEOMETRY") -> KernelTiles:
    """Apply an override string (``bt=2,bh=512,warps=8,grid=128,combine=pull,cbt=4,cwarps=8,hg=512,xeb=8,xw=4``:
    the ``tiles`` argument or TRITONEP_GEOMETRY, named ``source`` in errors) to ``g``.

    ``grid=`` without ``fs``/``fe`` selects the two-kernel dispatch with that grid; ``fs=0,fe=0`` turns the fused
    dispatch off while keeping the table's grids; ``dec=G`` selects the one-launch decode paths with G programs
    (``dec=0`` turns them off).

    ``hg=`` sets the chunk histogram's programs, ``xeb=`` / ``xw=`` the counts exchange's experts per tile and warps.

    Raises ConfigError naming the bad entry: unknown field, a value that is not a positive power of two (bt, bh,
    warps, cbt, cwarps, bbt, bwarps, xeb, xw), a grid, bgrid or hg < 1, or a combine kind other than push/pull.
    """
    from ...errors import ConfigError

    f = dict(bt=g.bt, bh=g.bh, num_warps=g.num_warps, combine=g.combine, fused_send=g.fused_send,
             fused_expand=g.fused_expand, fused_combine=g.fused_combine, decode=g.decode, cbt=g.cbt,
             cwarps=g.cwarps, prefetch=g.prefetch, bbt=g.bbt, bwarps=g.bwarps, bgrid=g.bgrid, grid_hist=g.grid_hist,
             xeb=g.xeb, xwarps=g.xwarps)
    grid = None
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in _OVERRIDE_FIELDS:
            raise ConfigError(f"{source} entry {item!r}: unknown field {key!r}; fields: {', '.join(_OVERRIDE_FIELDS)}")
        if key == "combine":
            if val not in ("push", "pull"):
                raise ConfigError(f"{source} entry {item!r}: combine must be push or pull")
            f["combine"] = val
            continue
        try:
            v = int(val)
        except ValueError:
            raise ConfigError(f"{source} entry {item!r}: {val!r} is not an integer") from None
        if key in ("grid", "bgrid", "hg"):
            if v < 1:
                raise ConfigError(f"{source} entry {item!r}: {key} must be >= 1")
            if key == "grid":
                grid = v
            else:
                f["grid_hist" if key == "hg" else "bgrid"] = v
        elif key in ("fc", "pf"):
            if v not in (0, 1):
                raise ConfigError(f"{source} entry {item!r}: {key} must be 0 or 1")
            f["fused_combine" if key == "fc" else "prefetch"] = bool(v)
        elif key == "dec":
            if v < 0:
                raise ConfigError(f"{source} entry {item!r}: dec must be >= 0")
            f["decode"] = v
        elif key in ("fs", "fe"):
            if v < 0:
                raise ConfigError(f"{source} entry {item!r}: {key} must be >= 0")
            f["fused_send" if key == "fs" else "fused_expand"] = v
        elif v < 1 or v & (v - 1):
            raise ConfigError(f"{source} entry {item!r}: {key} must be a positive power of two")
        else:
            f[{"warps": "num_warps", "xw": "xwarps"}.get(key, key)] = v
    gs = [grid] * 4 if grid else [g.grid_send, g.grid_expand, g.grid_partial, g.grid_out]
    keys = {p.strip().partition("=")[0].strip() for p in text.split(",") if p.strip()}
    if grid and not keys & {"fs", "fe"}:
        f["fused_send"] = f["fused_expand"] = 0  # grid= asks for the two-kernel path with that grid
        if "fc" not in keys:  # (an explicit fc=1 is refused below: it needs the fused roles grid= turned off)
            f["fused_combine"] = False
    if (f["fused_send"] > 0) != (f["fused_expand"] > 0) or len(keys & {"fs", "fe"}) == 1:
        raise ConfigError(f"{source} {text!r}: fs and fe must both be > 0 (fused dispatch) or both 0")
    if f["fused_combine"] and not f["fused_send"]:
        raise ConfigError(f"{source} {text!r}: fc=1 needs fs/fe > 0 (the role sizes), and the dispatch is "
                          "the two-kernel one here (the table's choice or fs=0,fe=0): give them, e.g. fs=40,fe=88,fc=1")
    return KernelTiles(bt=f["bt"], bh=f["bh"], grid_hist=f["grid_hist"], grid_send=gs[0], grid_expand=gs[1],
                    grid_partial=gs[2], grid_out=gs[3], num_warps=f["num_warps"], combine=f["combine"],
                    fused_send=f["fused_send"], fused_expand=f["fused_expand"], fused_combine=f["fused_combine"],
                    decode=f["decode"], cbt=f["cbt"], cwarps=f["cwarps"], prefetch=f["prefetch"], bbt=f["bbt"],
                    bwarps=f["bwarps"], bgrid=f["bgrid"], xeb=f["xeb"], xwarps=f["xwarps"])


def parse_tiles(text: str, source: str = "tiles") -> None:
    """Check an override string on its own (its fields and values; what only some configurations accept, e.g.
    ``dec=`` above the decode bound, is checked by :func:`select_tiles`).

    Raises:
        ConfigError: naming the bad entry (``source`` names where it came from).
    """
    base = KernelTiles(bt=16, bh=64, grid_hist=1, grid_send=1, grid_expand=1, grid_partial=1, grid_out=1,
                       num_warps=4, combine="push", fused_send=40, fused_expand=88)
    _apply_override(base, text, source)


def select_tiles(device_type: str, world_size: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 wire: str = "bf16", num_sms: int = 0, override="", combine: str = "",
                 max_programs: int = 0, source: str = "tiles") -> KernelTiles:
    """The kernel tiles of a static configuration (see module docstring); ``wire``: the dispatch wire's name.

    Args:
        num_sms: caps every grid (0: none): communication kernels then leave the rest of the chip free for expert
            GEMMs; an SM cap also picks paths of the table.
        override: an override string applied to the table's choice (``bt=2,dec=3``, module :func:`_apply_override`;
            the ``tiles`` argument of EPBuffer or TRITONEP_GEOMETRY), or a :class:`KernelTiles` taken as it is
            ("": none).
        combine: ``"push"`` / ``"pull"`` forces the combine kind (TRITONEP_COMBINE; "": the table's).
        max_programs: clips every grid too (0: none; set for ranks that share a GPU under MPS) but changes no choice
            of the table (fused or two-kernel dispatch, warps).
        source: where ``override`` came from, named in its errors (``"tiles"``, ``"TRITONEP_GEOMETRY"``).

    Raises:
        ConfigError: a bad override entry, or ``dec=`` above the decode bound.
    """
    if isinstance(override, KernelTiles):
        return override
    cap, forced = num_sms, combine
    if device_type != "cuda":
        bh = min(triton.next_power_of_2(hidden), 1024)
        g = KernelTiles(bt=16, bh=bh, grid_hist=1, grid_send=1, grid_expand=1, grid_partial=1, grid_out=1,
                     num_warps=4, combine="push")
    else:
        bh = min(triton.next_power_of_2(hidden), 1024)
        # token tile: about 128 (source, chunk) items over the grid; small batches (decode) take tiny tiles so every
        # SM gets work (4x faster at 128 tokens than 16-token tiles on 16 programs)
        bt = max(1, min(16 if topk <= 8 else 8, triton.next_power_of_2(triton.cdiv(world_size * max_tokens_per_rank,
                                                                                    128))))
        chunks = max(1, triton.cdiv(max_tokens_per_rank, bt))
        big = max_tokens_per_rank >= 1024
        grid = min(132, max(8, chunks * world_size))
        g = KernelTiles(bt=bt, bh=bh, grid_hist=min(132, chunks), grid_send=grid, grid_expand=grid,
                     grid_partial=grid, grid_out=grid, num_warps=8 if big else 4, combine="push")
        if big and not cap and not get_wire(wire).quantized and (world_size > 1 or max_tokens_per_rank < 4096):
            # one-launch fused dispatch, 40 senders + 88 expanders: it overlaps the NVLink send with the expand.
            # With an SM cap the split roles lose, so capped buffers keep the two kernels; quantized wires too (the
            # quantizing sender needs the whole grid); and world 1 from 4096 tokens (no peer, so no transfer for
            # the expand to overlap, and an eager synced call queues the send before its host read). Figures:
            # docs/performance.md, "Why the defaults"
            g = replace(g, fused_send=40, fused_expand=88)
        if max_tokens_per_rank <= DECODE_MAX_TOKENS:
            # the one-launch decode paths (one dispatch launch, one combine launch) for small batches: an eager call
            # is host-bound and one launch costs what one of the four launches of the two-kernel dispatch costs
            # (one token per tile up to 128 tokens: every program gets a chunk of every source at any world size)
            g = replace(g, decode=grid, bt=min(bt, triton.next_power_of_2(triton.cdiv(max_tokens_per_rank, 128))))
        if big and cap and wire == "fp8":
            # an SM-capped fp8 dispatch is bound by its quantizing sender's compute: 16 warps (+ the expander's
            # next-tile prefetch) at 24 SMs (bf16 gains nothing from either; docs/performance.md)
            g = replace(g, num_warps=16, prefetch=True)
        elif big and get_wire(wire).quantized:
            # quantizing (encoding / decoding) tiles are compute-bound at 8 warps: 16 measured faster at every
            # point (one H100, world 1, 4096 tokens: fp8 rows kept 196 vs 222 us, decoded 287 vs 326; mxfp4 kept
            # 172 vs 209, decoded 326 vs 364; benchmarks/results/ep_bench.h100x1.json)
            g = replace(g, num_warps=16)
        if big and wire == "mxfp4":
            # its expander encodes the own rows and decodes the peers' (codec stage_own off): spill-free at 8-token
            # tiles, which beat 16 (one H100, world 1, 4096 tokens: rows kept 136 vs 131 us but decoded 244 vs 515;
            # tritonep.wire.kernels.quant.MXFP4_CODEC)
            g = replace(g, bt=min(g.bt, 8))
        if big and not cap and world_size == 1 and max_tokens_per_rank >= 4096 and not get_wire(wire).quantized:
            # the world-1 bf16 expand (the only kernel that moves rows there): 8-token tiles 238 us vs 270 for 16
            # (one H100, 4096 tokens; 16 warps or a 264-program grid: no gain)
            g = replace(g, bt=8)
    if override:
        g = _apply_override(g, override, source)
    # the SM cap picks paths above; TRITONEP_MAX_PROGRAMS (ranks that share a GPU under MPS) only clips grids
    caps = [c for c in (cap, max_programs) if c]
    clip = min(caps) if caps else 0
    if clip:
        fs, fe, fc = g.fused_send, g.fused_expand, g.fused_combine
        if fs and clip < 2:  # a fused launch needs a sender and an expander at once: one program takes two kernels
            fs = fe = 0
            fc = False
        elif fs and fs + fe > clip:  # keep the role split, within the cap
            fs = max(1, clip * fs // (fs + fe))
            fe = max(1, clip - fs)
        g = replace(g, grid_hist=min(g.grid_hist, clip), grid_send=min(g.grid_send, clip),
                    grid_expand=min(g.grid_expand, clip), grid_partial=min(g.grid_partial, clip),
                    grid_out=min(g.grid_out, clip), fused_send=fs, fused_expand=fe, fused_combine=fc)
    if forced in ("push", "pull"):
        g = replace(g, combine=forced)
    # a fused path's two-kernel grids must equal its roles: both then add the same per-call counter totals
    if g.fused_send > 0:
        g = replace(g, grid_send=g.fused_send, grid_expand=g.fused_expand)
    if g.fused_combine:
        g = replace(g, grid_partial=g.fused_send, grid_out=g.fused_expand)
    if g.decode > 0:
        g = _decode_grids(g, max_tokens_per_rank, clip)
    # the combine's tile: a thread keeps all K gathered expert rows of its columns in flight only when its share of
    # the tile is small: 8 tokens x 32 warps (8 columns per thread, one 16-byte load per route) beat the dispatch's
    # 16 x 8 tile (which spills) by 1.7x at 132 SMs and 2.9x at 24 (docs/performance.md, "Why the defaults")
    if device_type == "cuda" and max_tokens_per_rank >= 1024:
        g = replace(g, cbt=g.cbt or 8, cwarps=g.cwarps or 32)
    if device_type == "cuda" and g.bt in _BWD_TILE:
        bbt, bwarps = _BWD_TILE[g.bt]
        g = replace(g, bbt=g.bbt or bbt, bwarps=g.bwarps or bwarps)
    # the backward expand's grid: every program the forward dispatch runs on (fused: both roles; 128 vs the 88
    # expanders at >= 1024 tokens), within the caps
    bgrid = g.bgrid or (g.fused_send + g.fused_expand if g.fused_send else g.grid_expand)
    return replace(g, cbt=g.cbt or g.bt, cwarps=g.cwarps or g.num_warps, bbt=g.bbt or g.bt,
                   bwarps=g.bwarps or g.num_warps, bgrid=min(bgrid, clip) if clip else bgrid)


def _decode_grids(g: KernelTiles, max_tokens_per_rank: int, cap: int | None) -> KernelTiles:
    """The one-launch decode tiles: ``decode`` clipped to the chunk count, 132 and the SM cap; every two-kernel
    grid equal to it (the counters then advance by the same per-call totals on either path); fused paths off.

    Raises ConfigError when ``max_tokens_per_rank`` exceeds the decode bound (the kernel holds every route in one
    tile)."""
    from ...errors import ConfigError

    if max_tokens_per_rank > DECODE_MAX_TOKENS:
        raise ConfigError(f"tiles dec={g.decode}: the one-launch decode path takes max_tokens_per_rank <= "
                          f"{DECODE_MAX_TOKENS}, got {max_tokens_per_rank}")
    G = max(1, min(g.decode, triton.cdiv(max_tokens_per_rank, g.bt), 132, cap or 132))
    return replace(g, decode=G, grid_send=G, grid_expand=G, grid_partial=G, grid_out=G, fused_send=0,
                   fused_expand=0, fused_combine=False)


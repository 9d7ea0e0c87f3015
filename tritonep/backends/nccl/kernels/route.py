"""Index work and packing of the nccl backend's dispatch: one kernel before the counts exchange, one after.

Names: T tokens, K = topk, E experts, W ranks, L = E // W local experts. A route is (token t, slot k) with
``0 <= topk_idx[t, k] < E``; its destination rank is ``id // L``. A packet is one (token, destination rank) with at
least one route there; the packet's FIRST route is the lowest k routing to that rank. Tokens are processed in
chunks of BT (chunk c = tokens ``[c*BT, c*BT + BT)``).

* :func:`route_count_kernel` (grid = chunks, >= 1): per chunk, the histogram of its routes over experts, of its
  packets over destination ranks and the count of ids outside ``[-1, E)``, into ``hist[c]``. The last program to
  arrive (an acq_rel ticket, reset by that program) turns ``hist`` into exclusive chunk prefixes in place and stores
  the column totals (the rank's counts row for the exchange) and the refused flag into ``row``.
* :func:`route_pack_kernel` (grid = chunks, after the exchange and the host plan): every route's destination row
  ``send_base[e] + prefix[c, e] + (routes to e before it inside the chunk)`` and every route's packet slot
  ``dest_start[d] + prefix[c, E + d] + (packets to d of earlier tokens inside the chunk)``; writes ``rows`` and
  ``pkt`` ([T, K] int32, -1 for masked slots) and packs each packet once into its send row: the token's wire row
  (one or two sources) and the meta (K rows, K ids, K weight bits, int32); it also copies ``topk_idx`` /
  ``topk_weights`` into the dispatch handle's own tensors (no separate clone launches).

Twins (the specification): :func:`tritonep.backends.nccl.route.count_row_torch` and
:func:`tritonep.backends.nccl.route.pack_send_torch`. Plain local loads and stores and one local ticket: no signals, no
waits (docs/protocols.md: non-signalling kernels may have data-dependent grids).
"""

import triton
import triton.language as tl

__all__ = ["route_count_kernel", "route_pack_kernel", "first_route", "column"]


@triton.jit
def first_route(dest, KB: tl.constexpr):
    """``[BT, KB]`` bool: route (t, k) is valid (``dest >= 0``) and no lower k of token t goes to the same rank."""
    k = tl.arange(0, KB)
    same = (dest[:, :, None] == dest[:, None, :]) & (k[None, None, :] < k[None, :, None])
    return (dest >= 0) & (tl.max(same.to(tl.int32), 2) == 0)


@triton.jit
def column(v, k, KB: tl.constexpr):
    """Column ``k`` of the integer tile ``v [BT, KB]`` as ``[BT]``."""
    return tl.sum(tl.where(tl.arange(0, KB)[None, :] == k, v, 0), 1)


@triton.jit(do_not_specialize=["T", "refused"])
def route_count_kernel(idx_ptr, hist_ptr, row_ptr, ticket_ptr, T, refused, K: tl.constexpr,
                       KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr, EB: tl.constexpr,
                       WB: tl.constexpr, BT: tl.constexpr, NCB: tl.constexpr, CB: tl.constexpr):
    """Counts row of this rank and the chunk prefixes (module docstring); grid-stride over the ``cdiv(T, BT)``
    chunks.

    ``hist`` int32 ``[>= NC, C]`` with C = E + W + 1 (experts | packets per rank | bad ids); ``row`` int32
    ``[C + 1]`` (the same columns summed over chunks, then ``refused``); ``ticket`` int32 ``[1]``, 0 between launches.
    """
    C: tl.constexpr = E + W + 1
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    NC = tl.cdiv(T, BT)
    t_off = tl.arange(0, BT)
    k_off = tl.arange(0, KB)
    e_off = tl.arange(0, EB)
    w_off = tl.arange(0, WB)
    for c in range(pid, NC, G):
        t = c * BT + t_off
        m2 = (t[:, None] < T) & (k_off[None, :] < K)
        raw = tl.load(idx_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], mask=m2, other=-1)
        bad = tl.sum(tl.sum(((raw < -1) | (raw >= E)).to(tl.int32), 1), 0)
        valid = (raw >= 0) & (raw < E)
        ids = tl.where(valid, raw, -1).to(tl.int32)
        h_e = tl.histogram(tl.reshape(ids, (BT * KB,)), EB, mask=tl.reshape(valid, (BT * KB,)))
        first = first_route(tl.where(valid, ids // L, -1), KB)
        dest = tl.where(first, ids // L, 0)
        h_d = tl.histogram(tl.reshape(dest, (BT * KB,)), WB, mask=tl.reshape(first, (BT * KB,)))
        base = hist_ptr + c * C
        tl.store(base + e_off, h_e, mask=e_off < E)
        tl.store(base + E + w_off, h_d, mask=w_off < W)
        tl.store(base + E + W, bad)
    # the last program to arrive sums and prefixes every chunk (its acq_rel ticket orders the other programs'
    # stores, made before their own ticket after a block barrier, before its loads); it resets the ticket
    tl.debug_barrier()
    old = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if old == G - 1:
        tl.debug_barrier()
        n_off = tl.arange(0, NCB)
        c_off = tl.arange(0, CB)
        for c0 in range(0, C, CB):
            cc = c0 + c_off
            carry = tl.zeros((CB,), dtype=tl.int32)
            for n0 in range(0, NC, NCB):
                nn = n0 + n_off
                m = (nn[:, None] < NC) & (cc[None, :] < C)
                p = hist_ptr + nn[:, None].to(tl.int64) * C + cc[None, :]
                h = tl.load(p, mask=m, other=0)
                tl.store(p, carry[None, :] + tl.cumsum(h, 0) - h, mask=m)
                carry += tl.sum(h, 0)
            tl.store(row_ptr + cc, carry, mask=cc < C)
        tl.store(row_ptr + C, refused)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["T", "HC"])
def route_pack_kernel(idx_ptr, w_ptr, src0_ptr, src1_ptr, hist_ptr, small_ptr, rows_ptr, pkt_ptr, send_ptr,
                      idx_copy_ptr, w_copy_ptr, T, HC,
                      K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                      BT: tl.constexpr, N0: tl.constexpr, ROW0: tl.constexpr, N1: tl.constexpr,
                      ROW1: tl.constexpr, COL1: tl.constexpr, META: tl.constexpr, ROW32: tl.constexpr,
                      BH: tl.constexpr):
    """Rows, packet slots and the packed send rows of chunks ``pid0, pid0 + G, ...`` (module docstring); program
    column ``pid1`` copies src0 elements ``[pid1 * HC, +HC)`` (HC a multiple of BH), column 0 also stores ``rows``,
    ``pkt``, the meta and src1 (the index work is redone per column: cheaper than a second launch).

    ``hist``: the exclusive chunk prefixes left by :func:`route_count_kernel` (``[cdiv(T, BT), E + W + 1]``); ``small``
    int32: ``send_base [E]`` then ``dest_start [W]`` (the host plan). Send row of packet s: ``src0[t, :N0]`` at
    element 0 (row stride ROW0 elements of src0's dtype), ``src1[t, :N1]`` at element COL1 (stride ROW1 of src1's
    dtype) when N1 > 0, and the int32 meta at int32 column META (stride ROW32): ``rows[t, :K] | topk_idx[t, :K] |
    bits of topk_weights[t, :K]``. Column 0 also stores the handle's own copy of the routing: ``idx_copy`` (the
    ids as loaded, same dtype) and ``w_copy`` (the weights' bits), so a dispatch needs no separate clone of either.
    """
    C: tl.constexpr = E + W + 1
    R: tl.constexpr = BT * KB
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    col0 = tl.program_id(1) == 0
    hs = tl.program_id(1) * HC
    he = tl.minimum(hs + HC, N0)
    NC = tl.cdiv(T, BT)
    t_off = tl.arange(0, BT)
    k_off = tl.arange(0, KB)
    i_off = tl.arange(0, R)
    h_off = tl.arange(0, BH)
    send32 = send_ptr.to(tl.pointer_type(tl.int32))
    send0 = send_ptr.to(tl.pointer_type(src0_ptr.dtype.element_ty))
    for c in range(pid, NC, G):
        t = c * BT + t_off
        tm = t < T
        m2 = tm[:, None] & (k_off[None, :] < K)
        tk = t[:, None].to(tl.int64) * K + k_off[None, :]
        raw = tl.load(idx_ptr + tk, mask=m2, other=-1)
        tl.store(idx_copy_ptr + tk, raw, mask=m2 & col0)
        valid = (raw >= 0) & (raw < E)
        ids = tl.where(valid, raw, -1).to(tl.int32)
        # destination rows: rank among the chunk's routes to the same expert by pairwise comparison
        fid = tl.reshape(ids, (R,))
        eq = (fid[:, None] == fid[None, :]) & (i_off[None, :] < i_off[:, None]) & (fid[None, :] >= 0)
        within = tl.reshape(tl.sum(eq.to(tl.int32), 1), (BT, KB))
        hrow = hist_ptr + c * C
        carry = tl.load(hrow + ids, mask=valid, other=0)
        base = tl.load(small_ptr + ids, mask=valid, other=0)
        rows = tl.where(valid, base + carry + within, -1)
        tl.store(rows_ptr + tk, rows, mask=m2 & col0)
        # packet slots: rank among the chunk's earlier tokens with a packet to the same rank
        dest = tl.where(valid, ids // L, -1)
        first = first_route(dest, KB)
        fd = tl.reshape(tl.where(first, dest, -1), (R,))
        dflat = tl.reshape(dest, (R,))
        tok = i_off // KB
        eqp = (dflat[:, None] == fd[None, :]) & (tok[None, :] < tok[:, None]) & (fd[None, :] >= 0)
        prank = tl.reshape(tl.sum(eqp.to(tl.int32), 1), (BT, KB))
        pc = tl.load(hrow + E + dest, mask=valid, other=0)
        ds = tl.load(small_ptr + E + dest, mask=valid, other=0)
        slot = tl.where(valid, ds + pc + prank, -1)
        tl.store(pkt_ptr + tk, slot, mask=m2 & col0)
        # meta of every packet (written by its first route)
        wv = tl.load(w_ptr + tk, mask=m2, other=0.0)
        tl.store(w_copy_ptr + tk, wv, mask=m2 & col0)
        wbits = wv.to(tl.int32, bitcast=True)
        raw32 = raw.to(tl.int32)
        fi = first.to(tl.int32)
        for k in tl.static_range(K):
            sk = column(slot, k, KB)
            fk = (column(fi, k, KB) > 0) & tm & col0
            mk = fk[:, None] & (k_off[None, :] < K)
            mb = send32 + sk.to(tl.int64)[:, None] * ROW32 + META + k_off[None, :]
            tl.store(mb, rows, mask=mk)
            tl.store(mb + K, raw32, mask=mk)
            tl.store(mb + 2 * K, wbits, mask=mk)
        # the token's wire row: loaded once, stored once per packet
        for h0 in range(hs, he, BH):
            h = h0 + h_off
            hm = h < he
            v = tl.load(src0_ptr + t[:, None].to(tl.int64) * N0 + h[None, :], mask=tm[:, None] & hm[None, :])
            for k in tl.static_range(K):
                sk = column(slot, k, KB)
                fk = (column(fi, k, KB) > 0) & tm
                tl.store(send0 + sk.to(tl.int64)[:, None] * ROW0 + h[None, :], v, mask=fk[:, None] & hm[None, :])
        if N1 > 0:
            if col0:
                send1 = send_ptr.to(tl.pointer_type(src1_ptr.dtype.element_ty))
                for h0 in range(0, N1, BH):
                    h = h0 + h_off
                    hm = h < N1
                    v = tl.load(src1_ptr + t[:, None].to(tl.int64) * N1 + h[None, :], mask=tm[:, None] & hm[None, :])
                    for k in tl.static_range(K):
                        sk = column(slot, k, KB)
                        fk = (column(fi, k, KB) > 0) & tm
                        tl.store(send1 + sk.to(tl.int64)[:, None] * ROW1 + COL1 + h[None, :], v,
                                 mask=fk[:, None] & hm[None, :])

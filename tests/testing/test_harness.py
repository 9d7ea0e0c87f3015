"""The dispatch/combine harness (tests.support.harness) fails where it must: records made from the reference pass,
and one flipped bit in any field, a wrong shape, rows past the end with a nonzero weight, or a second combine that
differs fails, naming the call, the rank and the field. Host only (no world)."""

import pytest
import torch

from tests.support.harness import FIELDS, check_calls, check_grads, diff, expected, make_calls

CFG = dict(E=8, H=32, Tmax=8, K=3, A=2)


def _records(calls):
    """Per rank, per call: the record a correct buffer gives (from the reference itself)."""
    W = len(calls)
    res = [[] for _ in range(W)]
    for i in range(len(calls[0])):
        want = expected([c[i] for c in calls], CFG["E"], CFG["A"])
        for r in range(W):
            rec = {f: want[r][f].clone() for f in FIELDS}
            rec["eo"] = (want[r]["x"].float() * 0.5 + 1.0).to(torch.bfloat16)
            res[r].append(rec)
    for i in range(len(calls[0])):  # y of the records' own expert outputs
        want = expected([c[i] for c in calls], CFG["E"], CFG["A"], eos=[res[r][i]["eo"] for r in range(W)])
        for r in range(W):
            res[r][i]["y"] = want[r]["y"]
    return res


def _flip(t):
    """``t`` with one bit of its last element flipped (any dtype)."""
    t = t.clone()
    flat = t.view(-1).view(torch.uint8)
    flat[-1] ^= 1
    return t


def test_reference_records_pass_and_every_flipped_field_fails():
    calls = make_calls(2, CFG, [7, 0], seeds=[1, 2])
    res = _records(calls)
    check_calls(CFG, calls, res)
    for field in FIELDS:
        bad = [[dict(rec) for rec in rank] for rank in res]
        if bad[0][1][field].numel() == 0:
            continue
        bad[0][1][field] = _flip(bad[0][1][field])
        with pytest.raises(AssertionError, match=rf"call 1 rank 0 .*'{field}'"):
            check_calls(CFG, calls, bad)


def test_shapes_padding_and_a_second_combine():
    calls = make_calls(2, CFG, [6, 4], seeds=[3])
    res = _records(calls)
    want = expected([c[0] for c in calls], CFG["E"], CFG["A"])
    rec = res[0][0]
    assert diff(dict(rec, x=rec["x"][:-1]), want[0]) == ["x"]
    padded = dict(rec, x=torch.cat([rec["x"], torch.ones(2, CFG["H"], dtype=torch.bfloat16)]),
                  w=torch.cat([rec["w"], torch.zeros(2)]))
    assert diff(padded, want[0]) == ["x", "w"] and diff(padded, want[0], padded=True) == []
    padded["w"][-1] = 0.5
    assert diff(padded, want[0], padded=True) == ["w past expert_offsets[-1]"]
    res[1][0]["y2"] = _flip(res[1][0]["y"])
    with pytest.raises(AssertionError, match="a second combine differs"):
        check_calls(CFG, calls, res)


def test_check_grads_fails_on_a_wrong_gradient():
    from tritonep.reference import combine_backward_reference, dispatch_backward_reference

    calls = make_calls(2, CFG, [5, 3], seeds=[4])
    ins = [c[0] for c in calls]
    want = expected(ins, CFG["E"], CFG["A"])
    ref = [w["ref"] for w in want]
    eos = [(r.x.float() * 0.5).to(torch.bfloat16) for r in ref]
    gs = [torch.randn(len(i[0]), CFG["H"], generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
          for r, i in enumerate(ins)]
    g_eo, g_w = combine_backward_reference(gs, eos, ref, [i[1] for i in ins], [i[2] for i in ins])
    gx = dispatch_backward_reference([0.5 * g.float() for g in g_eo], ref, [i[1] for i in ins],
                                     [len(i[0]) for i in ins])
    res = [dict(xin=i[0], idx=i[1], win=i[2], eo=eos[r], g=gs[r], geo=g_eo[r].to(torch.bfloat16), gx=gx[r],
                gw=g_w[r]) for r, i in enumerate(ins)]
    check_grads(CFG["E"], res, expert_alignment=CFG["A"])
    res[1]["gw"] = res[1]["gw"] + 0.1
    with pytest.raises(AssertionError, match="rank 1: gw"):
        check_grads(CFG["E"], res, expert_alignment=CFG["A"])


def test_check_script_bad_step_wants_the_bad_rank_input_error_naming_its_value():
    """A refused step of :func:`check_script`: the bad rank raises InputError naming its value whatever its T (the id
    E found on the device, or with no token the ``[0, K + 1]`` topk_idx refused at the front door; the harness used
    to expect PeerInputError from a T = 0 bad rank and planted nothing there, so a correct buffer failed), its peers
    PeerInputError naming it; anything else fails, naming the step."""
    from tests.support.harness import check_script

    cfg = dict(CFG, E=8, K=3)
    steps = [("bad", 1, [0, 3], 0), ("bad", 2, [2, 4], 1), ("cap", 3, [8, 8])]
    peer = lambda b: ("PeerInputError", f"dispatch: the input of rank(s) [{b}] was refused")  # noqa: E731
    good = [[("InputError", "topk_idx must have shape [num_tokens=0, topk=3], got (0, 4)"), peer(1),
             ("CapacityError", "")],
            [peer(0), ("InputError", "topk_idx[1, 0] = 8 is outside [-1, num_experts=8)"), ("CapacityError", "")]]
    check_script(cfg, steps, good)
    wrong = {"the old expectation at T = 0": (0, 0, peer(0)), "no error": (0, 0, ("no error", "")),
             "the value not named": (0, 0, ("InputError", "topk_idx must have shape")),
             "the peer names no rank": (1, 0, ("PeerInputError", "the input was refused")),
             "a device id not named": (1, 1, ("InputError", "topk_idx[1, 0] = 7 is outside"))}
    for what, (rank, step, rec) in wrong.items():
        res = [list(r) for r in good]
        res[rank][step] = rec
        try:
            check_script(cfg, steps, res)
        except AssertionError as e:
            assert str(e).startswith(f"({step}, "), (what, str(e))
        else:
            pytest.fail(f"check_script accepted {what}")

"""The compat Buffer's surface: the ``deep_ep`` alias, events, Config and size hints, what is refused (by name, with
a typed error), how a refused input on one rank raises on every rank, and capacity growth."""

import sys

import pytest
import torch

import tritonep.compat.deep_ep as compat
from tritonep.errors import BackendError, BufferStateError, ConfigError, InputError
from tritonep.testing import run_cpu_world
from tests.support.outcomes import refusal


def test_install_aliases_deep_ep(monkeypatch):
    for name in ("deep_ep", "deep_ep.utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(compat, "DEFAULTS", compat.DEFAULTS)  # restored after the test
    saved = dict(compat.DEFAULTS)
    try:
        compat.install(backend="nccl")
        import deep_ep
        from deep_ep import Buffer, Config
        from deep_ep.utils import EventHandle, EventOverlap

        assert deep_ep is compat and Buffer is compat.Buffer and Config is compat.Config
        assert EventOverlap is compat.EventOverlap and EventHandle is compat.EventHandle
        assert deep_ep.topk_idx_t is torch.int64 and compat.DEFAULTS["backend"] == "nccl"
        import importlib.util

        assert importlib.util.find_spec("deep_ep") is not None  # vLLM's has_deep_ep()
        with pytest.raises(ConfigError, match="no_such"):
            compat.install(no_such=1)
    finally:
        compat.DEFAULTS.clear()
        compat.DEFAULTS.update(saved)


def test_events_on_cpu():
    ev = compat.Buffer.capture()
    ev.current_stream_wait()  # nothing to wait for on a CPU
    with ev:
        pass
    with pytest.raises(InputError, match="async_finish"):
        compat.EventOverlap(None).current_stream_wait()
    with compat.EventOverlap(None, (torch.zeros(1),)) as e:
        assert e.extra_tensors is not None


def test_an_event_asks_for_cuda_once(monkeypatch):
    """``torch.cuda.is_available()`` (~0.6 us) is asked once, not per event; a replaced function is asked again."""
    asked = []

    def no_cuda():
        asked.append(1)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    assert all(compat.EventHandle().event is None for _ in range(5)) and len(asked) == 1
    with compat.Buffer.capture():
        pass
    assert len(asked) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(2) or False)
    assert compat.EventHandle().event is None and compat.EventHandle().event is None and asked == [1, 2]


def test_config_and_size_hints():
    c = compat.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (20, 6, 256)
    assert c.num_max_rdma_chunked_recv_tokens == 258  # rounded up to the send chunk, as DeepEP
    assert compat.Config(24, 8, 256).num_sms == 24
    for bad in ((-2,), (20, 0), (20, 8, 8), (20, 6, 256, 6, 6), (20, 6, 256, 0, 8)):
        with pytest.raises(ConfigError):
            compat.Config(*bad)
    for W in (1, 2, 3, 4, 8, 16):  # any group size (DeepEP's table covers 2, 4, 8, 16, ...)
        for cfg in (compat.Buffer.get_dispatch_config(W), compat.Buffer.get_combine_config(W)):
            assert cfg.num_sms == compat.Buffer.num_sms
            nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, W)
            assert nvl % 128 == 0 and nvl > cfg.get_nvl_buffer_size_hint(4096 * 2, W)
            assert (cfg.get_rdma_buffer_size_hint(7168 * 2, W) == 0) == (W <= 8)
    ll = compat.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert ll % 128 == 0 and ll > compat.Buffer.get_low_latency_rdma_size_hint(64, 7168, 8, 256)
    with pytest.raises(ConfigError):
        compat.Buffer.get_low_latency_rdma_size_hint(128, 100, 8, 256)
    with pytest.raises(ConfigError, match="even"):
        compat.Buffer.set_num_sms(3)
    assert compat.Buffer.is_sm90_compiled()


def _refusals(group):
    B = compat.Buffer
    out = []
    with pytest.raises(BackendError, match="enable_shrink"):
        B(group, 0, 0, enable_shrink=True)
    with pytest.raises(BackendError, match="comm"):
        B(None, comm=object())
    with pytest.raises(ConfigError, match="group"):
        B(None)
    buf = B(group, 0, 0, num_qps_per_rank=3, allow_nvlink_for_low_latency_mode=False, allow_mnnvl=True,
            use_fabric=True, explicitly_destroy=True, backend="nccl")
    assert buf.group_size == 1 and buf.rank == 0 and buf.get_comm_stream() is None
    x, idx = torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(ConfigError, match="low_latency_mode"):
        buf.low_latency_dispatch(x, idx, 4, 2)
    ll = B(group, 0, 0, low_latency_mode=True, backend="nccl")
    for call, name in ((lambda: ll.low_latency_dispatch(x, idx, 4, 2, dispatch_wait_recv_cost_stats=idx), "wait"),
                       (lambda: ll.low_latency_dispatch(x, idx, 4, 2, use_nvfp4=True), "nvfp4"),
                       (lambda: ll.low_latency_update_mask_buffer(0, True), "mask"),
                       (lambda: ll.low_latency_query_mask_buffer(idx), "mask"),
                       (lambda: ll.low_latency_clean_mask_buffer(), "mask"),
                       (lambda: ll.get_local_buffer_tensor(torch.int8), "get_local_buffer_tensor")):
        with pytest.raises(BackendError, match=name):
            call()
    with pytest.raises(InputError, match="return_recv_hook"):
        ll.low_latency_dispatch(x, idx, 4, 2, async_finish=True, return_recv_hook=True)
    recv, count, h, _, _ = ll.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)
    assert count.tolist() == [2, 0]
    for kw, name in (({"use_logfmt": True}, "use_logfmt"), ({"combine_wait_recv_cost_stats": idx}, "wait"),
                     ({"comp_signal": idx, "block_m": 64}, "block_m, comp_signal")):
        with pytest.raises(BackendError, match=name):
            ll.low_latency_combine(recv, idx, torch.ones(2, 1), h, **kw)
    with pytest.raises(InputError, match="zero_copy"):
        ll.low_latency_combine(recv, idx, torch.ones(2, 1), h, zero_copy=True)
    with pytest.raises(InputError, match="LowLatencyHandle"):
        ll.low_latency_combine(recv, idx, torch.ones(2, 1), (1, 2, 3, 4, 5))
    y, _, _ = ll.low_latency_combine(recv, idx, torch.full((2, 1), 0.5), h)
    assert torch.equal(y, (x.float() * 0.5).bfloat16())
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, 2)
    with pytest.raises(InputError, match="allocate_on_comm_stream"):
        buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte,
                     allocate_on_comm_stream=True)
    with pytest.raises(InputError, match="handle"):
        buf.combine(x, h)
    rx, _, _, counts, hn, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                           num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(2, 1))
    assert counts == [2, 0] and torch.equal(rx, x)
    with pytest.raises(InputError, match="topk"):
        buf.dispatch(x, handle=hn, topk_idx=idx)
    with pytest.raises(InputError, match="handle"):
        ll.combine(x, hn)  # a handle of another Buffer
    buf.destroy()
    ll.destroy()
    with pytest.raises(BufferStateError):
        buf.dispatch(x, handle=hn)
    out.append("ok")
    return out


def test_refused_by_name():
    assert run_cpu_world(1, _refusals) == [["ok"]]


def _bad_input_on_one_rank(group):
    """Rank 1's input is refused: it raises InputError naming the value, rank 0 PeerInputError (PeerConfigError when
    x itself has no row width to read on a fresh Buffer: the rows lane's construction then fails everywhere); no row
    moved and the next call pairs. Cases: lanes already made; a fresh Buffer whose first call is the bad one; the
    same with a float32 x (its width read: the peers' lane made); the same with a 1-D x."""
    rank, W = group.rank(), group.size()
    res = []
    for fresh, bad_x in ((False, False), (True, False), (True, "float"), (True, "1-D")):
        buf = compat.Buffer(group, 0, 0, backend="nccl")
        x = torch.randn(4, 128).bfloat16()
        idx = torch.tensor([[0], [1], [2], [3]])
        n, _, nte, itr, _ = buf.get_dispatch_layout(idx, 4)
        args = dict(num_tokens_per_rank=n, num_tokens_per_expert=nte, topk_idx=idx, topk_weights=torch.ones(4, 1))
        if not fresh:
            buf.dispatch(x, is_token_in_rank=itr, **args)
        bad = itr[:, :1] if rank == 1 and not bad_x else itr
        xb = x if rank != 1 or not bad_x else x.float() if bad_x == "float" else x.reshape(-1)
        res.append(refusal(lambda: buf.dispatch(xb, is_token_in_rank=bad, **args),
                           {"float": "x must be bfloat16", "1-D": "x must be a 2-D"}.get(bad_x, "is_token_in_rank")))
        rx, _, _, counts, _, _ = buf.dispatch(x, is_token_in_rank=itr, **args)
        res.append(counts)
        buf.destroy()
    return res


def test_bad_input_on_one_rank_raises_everywhere():
    r0, r1 = run_cpu_world(2, _bad_input_on_one_rank)
    assert r1 == ["own", [2, 2]] * 4
    assert r0 == ["peer", [2, 2], "peer", [2, 2], "peer", [2, 2], "peer-config", [2, 2]]


def _growth(group, backend):
    """The token capacity grows when a synced call needs more (collectively), handles made before stay valid; a
    fixed capacity refuses instead."""
    from tritonep.errors import CapacityError, PeerInputError

    rank = group.rank()
    buf = compat.Buffer(group, 0, 0, backend=backend)

    def call(T, b=buf, handle=None):
        x = (torch.arange(T * 128) % 251).view(T, 128).bfloat16() + rank
        idx = (torch.arange(T) % 4).view(T, 1)
        n, _, nte, itr, _ = b.get_dispatch_layout(idx, 4)
        return x, b.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte,
                             topk_idx=idx, topk_weights=torch.ones(T, 1))

    _, (rx1, _, _, c1, h1, _) = call(10)
    cap = buf.lanes.tcap
    _, (rx2, _, _, c2, h2, _) = call(10 if rank == 0 else 3 * cap)  # rank 1 goes over: both grow, then retry
    assert buf.lanes.tcap > cap
    x1 = (torch.arange(10 * 128) % 251).view(10, 128).bfloat16() + rank
    again = buf.dispatch(x1, handle=h1)[0]  # the handle from before the growth still works
    fixed = compat.Buffer(group, 0, 0, backend=backend, max_tokens_per_rank=16)
    call(16, fixed)
    try:
        call(17 if rank == 0 else 8, fixed)
        err = "none"
    except CapacityError:
        err = "own"
    except PeerInputError:
        err = "peer"
    buf.destroy()
    fixed.destroy()
    return torch.equal(again, rx1), c1, c2, err


@pytest.mark.parametrize("backend", ["nccl", pytest.param("triton", marks=pytest.mark.slow)])
def test_capacity_grows_collectively(backend):
    r0, r1 = run_cpu_world(2, _growth, backend)
    assert r0[0] and r1[0]
    assert r0[3] == "own" and r1[3] == "peer"
    assert r0[1] == [6, 6] and r0[2] == [3 + 48, 3 + 48]  # rank 1 sent 3 * 64 tokens, round-robin over 4 experts

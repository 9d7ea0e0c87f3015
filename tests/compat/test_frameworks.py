"""vLLM's and SGLang's DeepEP calls, replayed exactly on the compat Buffer in CPU worlds.

vLLM and SGLang need their CUDA builds, so their modules are not imported here; each rank function below makes the
same ``deep_ep`` calls, with the same arguments and the same handling of the results, as these sources (read at the
named commits; the line references are to those files):

* vLLM ``vllm/distributed/device_communicators/all2all.py`` @ 001430048e81: ``DeepEPHTAll2AllManager`` /
  ``DeepEPLLAll2AllManager._make_all2all_kwargs`` (the Buffer's arguments);
* vLLM ``vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ht.py`` @ 055e47c28003:
  ``DeepEPHTPrepareAndFinalize._do_dispatch`` / ``_receiver`` / ``_finalize`` (normal mode, bf16 and fp8 block scales,
  ``config`` None or DeepEP's recommended one, ``Buffer.capture`` events, ids made global again, weights applied
  before an unweighted combine);
* vLLM ``.../prepare_finalize/deepep_ll.py`` @ 055e47c28003: ``DeepEPLLPrepareAndFinalize.prepare_async`` /
  ``_finalize`` (low-latency mode, receive hook, ``out=``);
* SGLang ``python/sglang/srt/layers/moe/token_dispatcher/deepep.py`` @ 003a81bf2870: ``DeepEPBuffer
  .get_deepep_buffer`` / ``clean_buffer``, ``DeepEPConfig`` (``Config(**json)``), ``_DeepEPDispatcherImplNormal
  ._dispatch_core`` / ``_combine_core`` (``expert_alignment=128`` with DeepGEMM, column-major UE8M0 scales from its
  ``sglang_per_token_group_quant_fp8``) and ``_DeepEPDispatcherImplLowLatency._dispatch_core`` / ``_combine_core``
  (``buffer.group_size``, ``expected_m``, ``async_finish=not return_recv_hook``).

The expert computation between dispatch and combine is a stand-in whose result is known on the source rank.
"""

import pytest
import torch

from tests.compat.deepep_reference import assert_close, routing
from tritonep.testing import run_cpu_world

H, L, K = 256, 2, 3


def _expert(rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Stand-in expert: row * (1 + expert / 8), fp32."""
    return rows.float() * (1 + expert_ids.float() / 8)


def _vllm_ht(group, fp8: bool, backend: str):
    import tritonep.compat.deep_ep as deep_ep

    deep_ep.DEFAULTS["backend"] = backend  # the framework passes DeepEP's arguments only (a forked rank: no leak)
    rank, W = group.rank(), group.size()
    E = L * W
    # all2all.py DeepEPHTAll2AllManager._make_all2all_kwargs (intranode) + handle_cache.get_or_create(kwargs, Buffer)
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0, low_latency_mode=False,
                            num_qps_per_rank=1, explicitly_destroy=True)
    deep_ep.Buffer.set_num_sms(20)
    gen = torch.Generator().manual_seed(rank)
    T = 7 + 3 * rank
    a1 = torch.randn(T, H, generator=gen).bfloat16()
    topk_ids, topk_weights = routing(T, E, K, gen)
    topk_weights = topk_weights.nan_to_num(0.0)
    rank_expert_offset = rank * L
    available = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
    dcfg = deep_ep.Buffer.get_dispatch_config(W) if W in available else None
    ccfg = deep_ep.Buffer.get_combine_config(W) if W in available else None
    if fp8:  # prepare_async: block-quantized before the dispatch (a1q fp8 [T, H], a1q_scale [T, H / 128])
        xb = a1.float().view(T, H // 128, 128)
        amax = xb.abs().amax(2).clamp(min=1e-4)
        token_data = ((xb * (448 / amax[..., None])).to(torch.float8_e4m3fn).view(T, H), amax / 448)
        xr = (token_data[0].float().view(T, H // 128, 128) * token_data[1][..., None]).view(T, H)
    else:
        token_data, xr = a1, a1.float()
    # _do_dispatch
    previous_event = buffer.capture()
    (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
     event) = buffer.get_dispatch_layout(topk_idx=topk_ids, num_experts=E, previous_event=previous_event,
                                         async_finish=False, allocate_on_comm_stream=False)
    (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
     event) = buffer.dispatch(x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                              num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=topk_ids,
                              topk_weights=topk_weights, expert_alignment=1, config=dcfg,
                              previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False)
    # _receiver
    if event.event is not None:
        event.current_stream_wait()
    if fp8:
        expert_x, expert_x_scale = token_data
        expert_x = (expert_x.float().view(-1, H // 128, 128) * expert_x_scale[..., None]).view(-1, H)
    else:
        expert_x = token_data.float()
    expert_topk_ids = torch.where(expert_topk_ids == -1, E - 1 if rank_expert_offset == 0 else 0,
                                  expert_topk_ids + rank_expert_offset)
    assert sum(expert_num_tokens_per_expert_list) == int((expert_topk_weights != 0).sum())
    # experts + TopKWeightAndReduceContiguous: each row's local experts weighted and summed (weights 0 elsewhere)
    out = torch.zeros_like(expert_x)
    for k in range(K):
        out += expert_topk_weights[:, k:k + 1] * _expert(expert_x, expert_topk_ids[:, k:k + 1])
    fused_expert_output = out.bfloat16()
    # _finalize
    previous_event = buffer.capture()
    combined_x, _, event = buffer.combine(x=fused_expert_output, handle=handle, topk_weights=None, config=ccfg,
                                          previous_event=previous_event, async_finish=True,
                                          allocate_on_comm_stream=False)
    if event.event is not None:
        event.current_stream_wait()
    output = torch.empty_like(a1)
    output.copy_(combined_x, non_blocking=True)
    buffer.destroy()  # all2all.py DeepEPAll2AllManagerBase.destroy
    ref = sum(topk_weights[:, k:k + 1] * _expert(xr, topk_ids[:, k:k + 1]) * (topk_ids[:, k:k + 1] >= 0)
              for k in range(K))
    assert_close(output.float(), ref, rtol=2 ** -6, atol=2 ** -6)
    return True


def _vllm_ll(group, fp8: bool, backend: str):
    import tritonep.compat.deep_ep as deep_ep

    deep_ep.DEFAULTS["backend"] = backend  # the framework passes DeepEP's arguments only (a forked rank: no leak)
    rank, W = group.rank(), group.size()
    E, M = L * W, 16
    # all2all.py DeepEPLLAll2AllManager._make_all2all_kwargs
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1024 * 1024 * 1024,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(
                                num_max_dispatch_tokens_per_rank=M, hidden=H, num_ranks=W, num_experts=E),
                            low_latency_mode=True, num_qps_per_rank=L, allow_nvlink_for_low_latency_mode=True,
                            allow_mnnvl=False, explicitly_destroy=True, enable_shrink=False)
    gen = torch.Generator().manual_seed(10 + rank)
    T = 5 + 4 * rank
    a1 = torch.randn(T, H, generator=gen).bfloat16()
    topk_ids, topk_weights = routing(T, E, K, gen)
    topk_weights = topk_weights.nan_to_num(0.0)
    # prepare_async
    expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
        a1, topk_ids, M, E, use_fp8=fp8, round_scale=False, use_ue8m0=False, async_finish=False,
        return_recv_hook=True)
    hook()
    if fp8:  # _do_quant with block_k == 128: DeepEP quantized for us; the experts dequantize
        x_fp8, x_scales = expert_x
        expert_x = (x_fp8.float().view(L, -1, H // 128, 128) * x_scales.contiguous()[..., None]).view(L, -1, H)
    # batched experts: expert e's rows are its prefix [0, expert_num_tokens[e])
    fused = torch.zeros(L, W * M, H, dtype=torch.bfloat16)
    for j in range(L):
        n = int(expert_num_tokens[j])
        fused[j, :n] = _expert(expert_x[j, :n].float(), torch.tensor(rank * L + j)).bfloat16()
    # _finalize (weights applied by the combine)
    output = torch.empty(T, H, dtype=torch.bfloat16)
    _, _, recv_hook = buffer.low_latency_combine(fused, topk_ids, topk_weights, handle, async_finish=False,
                                                 zero_copy=False, return_recv_hook=True, out=output)
    recv_hook()
    buffer.destroy()
    from tritonep.wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch

    xr = dequantize_fp8_torch(*quantize_fp8_torch(a1), torch.float32) if fp8 else a1.float()
    ref = sum(topk_weights[:, k:k + 1] * _expert(xr, topk_ids[:, k:k + 1]).bfloat16().float()
              * (topk_ids[:, k:k + 1] >= 0) for k in range(K))
    assert_close(output.float(), ref, rtol=2 ** -6, atol=2 ** -6)
    return True


def _sglang(group, mode: str, backend: str):
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.compat.deep_ep import Buffer, Config

    deep_ep.DEFAULTS["backend"] = backend  # the framework passes DeepEP's arguments only (a forked rank: no leak)
    H = 512  # four UE8M0 scales per int32
    rank, W = group.rank(), group.size()
    E, M = L * W, 16
    # DeepEPConfig: a --deepep-config JSON (Config(**config_dispatch)); DeepEPBuffer.get_deepep_buffer (AUTO mode)
    normal_dispatch_config = Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                                       "num_max_nvl_chunked_recv_tokens": 256,
                                       "num_max_rdma_chunked_send_tokens": 6,
                                       "num_max_rdma_chunked_recv_tokens": 128})
    hidden_bytes = H * 1
    num_nvl_bytes = max(normal_dispatch_config.get_nvl_buffer_size_hint(hidden_bytes, W),
                        Buffer.get_combine_config(W).get_nvl_buffer_size_hint(hidden_bytes, W))
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(M, H, W, E)
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                    num_qps_per_rank=max(normal_dispatch_config.num_sms, E // W), allow_mnnvl=True)
    gen = torch.Generator().manual_seed(20 + rank)
    T = 6 + 5 * rank
    hidden_states = torch.randn(T, H, generator=gen).bfloat16()
    topk_ids, topk_weights = routing(T, E, K, gen)
    topk_weights = topk_weights.nan_to_num(0.0)
    topk_ids = topk_ids.to(torch.int64)
    if mode == "normal":
        # dispatch_a with DeepGEMM: per-token-group fp8 with column-major, TMA-aligned UE8M0 scales (int32)
        xb = hidden_states.float().view(T, H // 128, 128)
        scale = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(2).clamp(min=1e-4) / 448)))
        q = (xb / scale[..., None]).to(torch.float8_e4m3fn).view(T, H)
        ue = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).contiguous().view(torch.int32)
        x = (q, ue.T.contiguous().T)
        previous_event = Buffer.capture()  # async_finish=True
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = buffer.get_dispatch_layout(topk_ids, E, previous_event=previous_event, async_finish=True,
                                                      allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event) = buffer.dispatch(
            x, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=True,
            allocate_on_comm_stream=(previous_event is not None) and True, expert_alignment=128,
            config=normal_dispatch_config)
        event.current_stream_wait()
        hidden, hidden_scale = recv_x
        assert hidden_scale.dtype == torch.int32 and all(c % 128 == 0 for c in num_recv_tokens_per_expert)
        sc = (hidden_scale.contiguous().view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        xd = (hidden.float().view(-1, H // 128, 128) * sc[..., None]).view(-1, H)
        out = torch.zeros_like(xd)
        for k in range(K):  # the runner weights the rows of its local experts
            ids = torch.where(recv_topk_ids[:, k] >= 0, recv_topk_ids[:, k] + rank * L, 0)
            out += recv_topk_weights[:, k:k + 1] * _expert(xd, ids[:, None])
        previous_event = Buffer.capture()
        combined_x, _, event = buffer.combine(out.bfloat16(), handle, async_finish=True,
                                              previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None, config=None)
        event.current_stream_wait()
        xr = (q.float().view(T, H // 128, 128) * scale[..., None]).view(T, H)
    else:
        buffer.clean_low_latency_buffer(M, H, E)  # DeepEPBuffer.set_dispatch_mode_as_low_latency after normal
        expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + E) // E
        assert expected_m >= 1
        return_recv_hook = True
        packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
            hidden_states, topk_ids, M, E, use_fp8=False, async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook)
        hook()
        masked_m = packed_recv_count
        fused = torch.zeros(L, W * M, H, dtype=torch.bfloat16)
        for j in range(L):
            n = int(masked_m[j])
            fused[j, :n] = _expert(packed_recv_hidden[j, :n], torch.tensor(rank * L + j)).bfloat16()
        combined_x, event, hook = buffer.low_latency_combine(x=fused, topk_idx=topk_ids, topk_weights=topk_weights,
                                                             handle=handle, async_finish=not return_recv_hook,
                                                             return_recv_hook=return_recv_hook)
        hook()
        xr = hidden_states.float()
    buffer.destroy()
    ref = sum(topk_weights[:, k:k + 1] * _expert(xr, topk_ids[:, k:k + 1]) * (topk_ids[:, k:k + 1] >= 0)
              for k in range(K))
    assert_close(combined_x.float(), ref, rtol=2 ** -6, atol=2 ** -6)
    return True


SLOW = pytest.mark.slow  # the triton backend's kernels in the interpreter: ~5 s per world
BACKENDS = ["nccl", pytest.param("triton", marks=SLOW)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_vllm_high_throughput_calls(fp8, backend):
    assert run_cpu_world(2, _vllm_ht, fp8, backend) == [True, True]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_vllm_low_latency_calls(fp8, backend):
    assert run_cpu_world(2, _vllm_ll, fp8, backend) == [True, True]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_sglang_calls(mode, backend):
    assert run_cpu_world(2, _sglang, mode, backend) == [True, True]

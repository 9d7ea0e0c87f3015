"""tritonep under torchrun: EPBuffer dispatch/combine and an MoE layer forward + backward, each checked.

    torchrun --nproc-per-node 2 examples/torchrun_moe.py    # 2 GPUs of one host, NCCL process group
    torchrun --nproc-per-node 4 examples/torchrun_moe.py    # 4 processes on fewer GPUs: they share GPUs (below)
    python examples/torchrun_moe.py                         # no GPU: the same main() in a 2-rank CPU world
    torchrun --nproc-per-node 2 examples/torchrun_moe.py    # no GPU: a gloo group and backend="nccl" (below)

``main(group)`` is the per-rank body (tests/docs/test_examples.py runs it in a CPU world,
tests/docs/test_torchrun_cpu.py under torchrun without a GPU). It raises AssertionError if a result is off and
returns the measured errors.

Without a GPU, torchrun's processes share no memory, so the ``triton`` backend (symmetric memory: in a CPU world one
fork + mmap heap) has nothing to map; the ``nccl`` backend needs none: its exchanges are ``torch.distributed``
collectives, which a gloo group runs on CPU tensors, and its few kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before tritonep's kernels are imported). Same API and same bits as in a CPU world.

More processes than GPUs (``LOCAL_WORLD_SIZE`` > GPUs), e.g. developing on one GPU before renting eight:

* what works: process ``r`` uses ``cuda:{r % num_gpus}`` with a **gloo** group and
  ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; tritonep's symmetric memory, kernels, barriers and the MoE layer
  run unchanged and every check below passes (docs/platform.md, "Several ranks on one GPU").
* what does not: an NCCL group (NCCL refuses two ranks on one GPU), so neither the ``nccl`` backend's NCCL path nor
  NCCL baselines; meaningful timings (the ranks time-slice the GPU: every cross-rank wait costs a time slice, 2.5 ms
  at 2 ranks, 4.5 ms at 4 on an H200; and nothing crosses NVLink); running them at once needs an MPS daemon you
  start yourself (``nvidia-cuda-mps-control -d``, with every rank's ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` summing to
  <= 100 and ``TRITONEP_MAX_PROGRAMS`` set to each rank's share of the SMs) -- ``tritonep.testing.run_gpu_world(N,
  fn, mps=True)`` and ``tritonep run --world-size N --mps on`` do all of that for you.
"""

import os

import torch

if not torch.cuda.is_available():  # no GPU: Triton's interpreter, set before torch._dynamo imports triton.language
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch._dynamo  # noqa: E402, F401  (before init_process_group: see below)
import torch.distributed as dist

import tritonep as tep
from tritonep.reference import moe_dense_reference


def main(group, backend="auto"):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    H, I, E, K, T = (2048, 1024, 64, 6, 512) if dev.type == "cuda" else (64, 32, 8, 2, 6)  # tiny on a CPU
    torch.manual_seed(rank)  # each rank its own tokens

    # 1. EPBuffer: send every token to its K experts and back; here the "experts" double their rows
    buf = tep.EPBuffer(group, num_experts=E, hidden=H, max_tokens_per_rank=T, topk=K, device=dev, backend=backend)
    x = torch.randn(T, H, device=dev).bfloat16()
    topk_idx = torch.rand(T, E, device=dev).argsort(dim=1)[:, :K]  # K distinct experts per token
    topk_weights = torch.rand(T, K, device=dev)
    out = buf.dispatch(x, topk_idx, topk_weights)  # out.x: the rows this rank's experts got, grouped by expert
    y = buf.combine(out.x * 2, out.handle)  # y[t] = sum_k topk_weights[t, k] * 2 x[t]
    buf.close()
    expect = 2 * x.float() * topk_weights.sum(1, keepdim=True)
    dispatch_err = float((y.float() - expect).abs().max() / expect.abs().max())
    assert dispatch_err < 2e-2, f"rank {rank}: dispatch/combine off by {dispatch_err:.2e}"

    # 2. MoELayer: router + SwiGLU experts (E / world per rank), forward and backward
    geo = tep.MoEGeometry(hidden=H, intermediate=I, num_experts=E, topk=K, max_tokens_per_rank=T)
    layer = tep.MoELayer(tep.MoERecipe(), geo, group, device=dev, seed=0, backend=backend)
    x = torch.randn(T, H, device=dev).bfloat16().requires_grad_(True)
    topk_idx, topk_weights = layer.router(x)  # what layer(x) does; kept here for the check below
    y = layer(x, topk_idx=topk_idx, topk_weights=topk_weights)
    y.float().square().mean().backward()  # gradients reach x, the router and this rank's experts
    assert x.grad is not None and layer.w1.grad is not None and layer.router.weight.grad is not None

    # check the forward: the dense single-process reference over every rank's tokens, same weights
    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    w1, w2 = tep.MoELayer.init_expert_weights(geo, seed=0, device=dev)  # drawn where the layers drew theirs
    ref = moe_dense_reference(gather(x.detach().float()), gather(topk_idx), gather(topk_weights.detach()),
                              w1.float().to(dev), w2.float().to(dev))[rank * T:(rank + 1) * T]
    moe_err = float((y.detach().float() - ref).abs().max() / ref.abs().max())
    assert moe_err < 3e-2, f"rank {rank}: MoE layer output off by {moe_err:.2e}"
    layer.close()
    if rank == 0:
        print(f"world {world} on {dev.type}, {buf.backend} backend: dispatch/combine error {dispatch_err:.1e}, "
              f"MoE layer error {moe_err:.1e} vs the dense reference; backward done")
    return {"dispatch_err": dispatch_err, "moe_err": moe_err, "grad_x_norm": float(x.grad.float().norm())}


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),  # --help: what it does, no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if torch.cuda.is_available():  # under torchrun: one process per GPU (more processes than GPUs: see the docstring)
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)  # multicast off (README, "Install on a GPU machine")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        ngpu = torch.cuda.device_count()
        if int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > ngpu:  # processes share GPUs: correct, timings meaningless
            os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")  # symmetric memory on one GPU
            torch.cuda.set_device(local_rank % ngpu)
            dist.init_process_group("gloo")  # NCCL refuses two ranks on one GPU
        else:
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        main(dist.group.WORLD)
        dist.barrier()  # no rank tears its group down while a peer still talks to it
        dist.destroy_process_group()
    # torch._dynamo is imported above, before the group exists: torch's custom ops (the MoE layer's) import it on their
    # first call, and that import (torch.distributed.nn.functional) binds the default group into default arguments
    # (torch 2.11-2.13), which then keep it alive past destroy_process_group until the interpreter exits, where
    # destroying a gloo group can abort the process ("terminate called without an active exception")
    elif "LOCAL_RANK" in os.environ:  # torchrun without a GPU: a gloo group and the nccl backend (below)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before tritonep's kernels are imported (main imports them)
        dist.init_process_group("gloo")
        main(dist.group.WORLD, backend="nccl")
        dist.barrier()  # no rank tears the gloo pairs down while a peer still uses them (else: an abort at exit)
        dist.destroy_process_group()
    else:  # no GPU: forked CPU ranks sharing one heap, kernels in Triton's interpreter
        from tritonep.testing import run_cpu_world

        run_cpu_world(2, main)

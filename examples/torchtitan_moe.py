"""Train a small torchtitan MoE model for a few steps with tritonep's token dispatcher (expert parallel).

    python examples/torchtitan_moe.py                          # no GPU: main() in a 2-rank CPU world (interpreter)
    torchrun --nproc-per-node 2 examples/torchtitan_moe.py     # 2 GPUs of one host (1 works too: EP degree 1)

Under torchrun without a GPU it stops with one line: the dispatcher builds its ``EPBuffer`` with the ``triton``
backend (symmetric memory), which a CPU has only inside ``run_cpu_world``'s forked ranks (examples/torchrun_moe.py
and train_moe.py run under torchrun on a CPU with the ``nccl`` backend instead).

The MoE layers are torchtitan 0.3.0's own ``MoE`` modules, configured as its DeepSeek-V3 ``debugmodel`` MoE layer
(dim 256, 8 routed experts, top-3, 2 shared experts); :func:`tritonep.integrations.torchtitan.use_tritonep` swaps
their token dispatcher for tritonep's and :func:`shard_routed_experts` gives every rank its 8 / W experts. Around them:
an embedding, RMSNorm residual blocks and an output head (torch modules), trained on a synthetic next-token task
with AdamW; every rank is a data-parallel replica of the dense weights (their gradients are all-reduced) and owns
its experts. The full DeepSeek-V3 model is not used here because torch's FlexAttention has no backward on a CPU.

With torchtitan's own trainer (full model, GPUs) select the dispatcher with its override mechanism instead::

    torchrun --nproc-per-node 8 -m torchtitan.train --module deepseek_v3 --config deepseek_v3_16b \\
        --parallelism.expert_parallel_degree 8 --training.disable_cuda_graphs \\
        --override.imports 'tritonep.integrations.torchtitan.tritonep_token_dispatcher={"num_max_tokens_per_rank": 16384}'

``main(group)`` is the per-rank body (tests/docs/test_examples.py runs it in a CPU world); it raises AssertionError when
the loss does not fall and returns the losses.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if not torch.cuda.is_available():  # no GPU: tritonep's kernels run in Triton's interpreter, which Triton reads when
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a kernel is defined: before the next import defines them
    # torchtitan's router asks CPU autocast for fp32, which CPU autocast does not offer (it turns itself off; the
    # model is fp32 here anyway): a warning from every rank, nothing wrong
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")

from tritonep.integrations.torchtitan import close_buffers, shard_routed_experts, use_tritonep  # noqa: E402


def moe_layer_config(**dispatcher_fields):
    """torchtitan's DeepSeek-V3 debugmodel MoE layer config, with tritonep's token dispatcher. Built from
    ``torchtitan.models.common`` classes, equal to ``deepseekv3_configs["debugmodel"](...).layers[1].moe`` (torchtitan
    0.3.0's ``deepseek_v3`` package needs ``torch.distributed.fsdp.DataParallelMeshDims``, absent in torch 2.11)."""
    from tritonep.testing.torchtitan_compat import deepseek_v3_moe_config

    return use_tritonep(deepseek_v3_moe_config("debugmodel"), **dispatcher_fields)


class TinyMoEModel(nn.Module):
    """Embedding -> n x (x + MoE(RMSNorm(x))) -> RMSNorm -> head; the MoE blocks are torchtitan's ``MoE``."""

    def __init__(self, vocab, n_layers, **dispatcher_fields):
        super().__init__()
        cfgs = [moe_layer_config(**dispatcher_fields) for _ in range(n_layers)]
        dim = cfgs[0].routed_experts.inner_experts.dim
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in cfgs)
        self.moes = nn.ModuleList(c.build() for c in cfgs)
        for moe in self.moes:
            moe.init_states()
        self.out_norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(self.out_norm(h))


def batch(step, rank, B, S, vocab, device):
    """Sequences of the rule ``next = (3 * tok + 1) % vocab`` from random starts (learnable next-token data)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (B, 1), generator=g)
    seq = [start]
    for _ in range(S):
        seq.append((3 * seq[-1] + 1) % vocab)
    seq = torch.cat(seq, 1).to(device)
    return seq[:, :-1], seq[:, 1:]


def main(group, steps=4, n_layers=1, B=1, S=16, vocab=64):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)  # the same dense weights on every rank
    model = TinyMoEModel(vocab, n_layers, hidden_dim=256, num_max_tokens_per_rank=B * S).to(dev)
    shard_routed_experts(model, DeviceMesh(dev.type, list(range(world))))  # experts [r*L, (r+1)*L) stay here
    expert_params = {p for moe in model.moes for p in moe.routed_experts.inner_experts.parameters()}
    dense = [p for p in model.parameters() if p not in expert_params]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens, labels = batch(step, rank, B, S, vocab, dev)
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / world  # the mean over ranks
        loss.backward()  # expert gradients arrive from every rank's tokens through combine / dispatch backward
        for p in dense:  # data parallel over the EP group for the replicated weights
            dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.4f}", flush=True)
    close_buffers()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    return losses


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),  # --help: what it does, no options
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if "RANK" in os.environ and not torch.cuda.is_available():  # one line, not a HeapError traceback from every rank
        sys.exit("examples/torchtitan_moe.py under torchrun needs GPUs: tritonep's torchtitan dispatcher uses the "
                 "triton backend, whose symmetric memory a CPU has only inside run_cpu_world's forked ranks; without a "
                 "GPU run: python examples/torchtitan_moe.py")
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        main(dist.group.WORLD, steps=20, n_layers=2, B=4, S=256, vocab=2048)
        dist.destroy_process_group()
    else:
        from tritonep.testing import run_cpu_world

        print("losses per rank:", run_cpu_world(2, main, timeout_s=600))

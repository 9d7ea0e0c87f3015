"""Train a small MoE transformer block with tritonep: data parallel x expert parallel, AdamW, DeepSeek-V3 routing with
aux-loss-free balancing and a shared expert, checkpoint save + bit-exact resume, a loss curve.

    torchrun --nproc-per-node 4 examples/train_moe.py --ep 2            # GPUs of one host: DP 2 x EP 2
    python examples/train_moe.py                                        # no GPU: a 4-rank CPU world (DP 2 x EP 2)
    torchrun --nproc-per-node 4 examples/train_moe.py                   # no GPU: gloo, EP groups on the nccl backend
    python examples/train_moe.py --steps 300 --plot                     # the loss curve: out/train_moe/loss.png
    python examples/train_moe.py --steps 20 --save-at 10 --ckpt out/ck  # save after step 10 ...
    python examples/train_moe.py --steps 20 --resume --ckpt out/ck      # ... resume: the same losses, bit for bit
    python examples/train_moe.py --steps 20 --resume --ckpt out/ck --ep 4  # at EP 4 (DP 1): within 1e-3, other sums

The model: token embedding -> RMSNorm -> causal self-attention -> RMSNorm -> MoE layer (routed experts over the EP
group + a shared expert) -> RMSNorm -> vocabulary head. The data: sequences of a fixed random Markov chain whose every
token has 4 likely successors, drawn from (seed, step, rank) alone, so a resumed run sees the same batches; the
loss falls from ln(64) = 4.16 towards the chain's entropy (:func:`chain_entropy`, 1.93 nats for seed 0).

Per step (docs/moe.md, "Train a real model"): forward, backward, :func:`tritonep.moe.reduce_gradients` (router,
shared expert, attention, ... summed over all ranks; experts over the ranks that hold the same experts; both divided
by the world size), AdamW, :func:`tritonep.moe.update_router_biases` (the aux-loss-free bias update over all ranks).
Checkpoints: :mod:`tritonep.moe.checkpoint` (torch.distributed.checkpoint; experts keyed by global id, so a
checkpoint can be loaded at another EP size).

``main(group, argv)`` is the per-rank body (tests/docs/test_train_example.py runs it in a CPU world); it returns the loss of
every step (the mean over all ranks) and the final weights' checksums.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():  # no GPU: tritonep's kernels run in Triton's interpreter, which Triton reads when
    os.environ.setdefault("TRITON_INTERPRET", "1")  # a kernel is defined: before tritonep.moe imports them (below)

import tritonep as tep  # noqa: E402
from tritonep.moe import RouterConfig, reduce_gradients, update_router_biases  # noqa: E402
from tritonep.moe import checkpoint as ckpt  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=2,
                   help="expert-parallel group size (the world divides into DP x EP; default 2)")
    p.add_argument("--steps", type=int, default=300,
                   help="train until this step (counted from 0, resumes included; default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data's Markov chain (default 0)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (--save-at writes it, --resume reads it)")
    p.add_argument("--resume", action="store_true", help="load --ckpt and continue from its step")
    p.add_argument("--log", default=None, help="write the per-step losses as JSON (rank 0)")
    p.add_argument("--out", default=os.path.join("out", "train_moe"),
                   help="output folder of --plot (created if missing; default out/train_moe, which git ignores)")
    p.add_argument("--plot", action="store_true", help="draw the loss curve into OUT/loss.png (rank 0, matplotlib)")
    p.add_argument("--backend", default=None, help="EPBuffer backend (default: auto on GPU, nccl in a CPU world)")
    args = p.parse_args(argv)
    if (args.save_at is not None or args.resume) and not args.ckpt:
        p.error("--save-at and --resume need --ckpt DIR (the checkpoint directory)")
    return args


VOCAB = 64


def sizes(device_type):
    """(hidden, expert width, experts, top-k, shared width): tiny on a CPU, a little larger on GPUs."""
    return (64, 32, 8, 2, 32) if device_type == "cpu" else (256, 256, 16, 2, 256)


def chain_entropy(seed) -> float:
    """The chain's next-token entropy in nats, averaged over the current token (the loss a perfect model reaches)."""
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(seed))
    p = torch.full((VOCAB, VOCAB), 0.1 / VOCAB).scatter_add_(1, succ, torch.full((VOCAB, 4), 0.9 / 4))
    return float(-(p * p.log()).sum(1).mean())


def batch(seed, step, rank, n, seq, device):
    """``n`` sequences of the fixed Markov chain (its 4 likely successors per token), from (seed, step, rank)."""
    chain = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=chain)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    tok = torch.empty(n, seq + 1, dtype=torch.long)
    tok[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(seq):
        pick = torch.randint(0, 4, (n,), generator=g)
        noise = torch.rand(n, generator=g) < 0.1  # 10% of steps jump anywhere
        nxt = succ[tok[:, t], pick]
        tok[:, t + 1] = torch.where(noise, torch.randint(0, VOCAB, (n,), generator=g), nxt)
    return tok[:, :-1].to(device), tok[:, 1:].to(device)


class Block(nn.Module):
    """Embedding -> attention -> MoE -> head; every residual branch pre-normalised."""

    def __init__(self, ep_group, device, tokens_per_rank, seed, backend):
        super().__init__()
        H, inter, E, K, shared = sizes(device.type)
        torch.manual_seed(seed)  # the replicated parameters: the same on every rank
        self.embed = nn.Embedding(VOCAB, H, device=device)
        self.norm1, self.norm2, self.norm3 = (nn.RMSNorm(H, device=device) for _ in range(3))
        self.qkv = nn.Linear(H, 3 * H, bias=False, device=device)
        self.proj = nn.Linear(H, H, bias=False, device=device)
        self.head = nn.Linear(H, VOCAB, bias=False, device=device)
        geo = tep.MoEGeometry(hidden=H, intermediate=inter, num_experts=E, topk=K, max_tokens_per_rank=tokens_per_rank,
                              shared_intermediate=shared)
        recipe = tep.MoERecipe(router=RouterConfig(kind="deepseek_v3", n_group=2, topk_group=2,
                                                   routed_scaling_factor=1.0, bias_update_rate=1e-3))
        self.moe = tep.MoELayer(recipe, geo, ep_group, device=device, dtype=torch.float32, seed=seed,
                                backend=backend)
        self.heads = 4

    def forward(self, tokens):
        B, S = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1))
        h = self.norm2(x).reshape(B * S, -1).bfloat16()  # tokens travel as bf16 through the MoE layer
        x = x + self.moe(h).float().view(B, S, -1)
        return self.head(self.norm3(x))


def groups(world_group, ep):
    """(EP group, expert-DP group) of this rank: EP groups are consecutive ranks, DP replicas stride by ``ep``."""
    W, rank = dist.get_world_size(world_group), dist.get_rank(world_group)
    if W % ep:
        raise SystemExit(f"--ep {ep} does not divide the world size {W}")
    ep_groups = [dist.new_group(list(range(d * ep, (d + 1) * ep))) for d in range(W // ep)]
    dp_groups = [dist.new_group(list(range(e, W, ep))) for e in range(ep)]
    return ep_groups[rank // ep], dp_groups[rank % ep]


def main(group, argv=None):
    args = parse_args(argv)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    backend = args.backend or ("auto" if device.type == "cuda" else "nccl")  # CPU heap: whole-world groups only
    ep_group, dp_group = groups(group, args.ep)
    model = Block(ep_group, device, args.batch * args.seq, args.seed, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start = 0
    if args.resume:
        start = ckpt.load(args.ckpt, model, opt, extra={"step": 0}, group=group)["step"]
    losses = []
    for step in range(start, args.steps):
        x, target = batch(args.seed, step, rank, args.batch, args.seq, device)
        loss = F.cross_entropy(model(x).flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        reduce_gradients(model, group, dp_group)  # replicated over the world, experts over their DP replicas
        opt.step()
        update_router_biases(model, group)  # aux-loss-free balancing: counts summed over every rank
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / W)
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
        if args.save_at is not None and step + 1 == args.save_at:
            ckpt.save(args.ckpt, model, opt, extra={"step": step + 1}, group=group)
    result = {"start": start, "losses": losses,
              "weights": {n: p.detach().double().sum().item() for n, p in model.named_parameters()},
              "bias": model.moe.router.e_score_correction_bias.tolist(),
              "w1": model.moe.w1.detach().clone().cpu(), "router": model.moe.router.weight.detach().clone().cpu()}
    if rank == 0:
        write_outputs(args, start, losses, W)
    model.moe.close()
    return result


def plot_path(args) -> str:
    """Where ``--plot`` draws: ``loss.png`` in the output folder (``--out``), never a file of the repository's docs."""
    return os.path.join(args.out, "loss.png")


def plot_title(args, world_size: int) -> str:
    """The loss curve's title: this run's DP x EP split of ``world_size`` ranks (``--ep``)."""
    return f"examples/train_moe.py: DP {world_size // args.ep} x EP {args.ep}, DeepSeek-V3 router + shared expert"


def write_outputs(args, start, losses, world_size):
    """The JSON log and the loss-curve PNG of rank 0 (``--log`` / ``--plot``: :func:`plot_path`)."""
    if args.log:
        with open(args.log, "w") as f:
            json.dump({"start": start, "losses": losses}, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=120)
        steps = list(range(start, start + len(losses)))
        ax.plot(steps, losses, lw=1.2, label="train loss (mean over ranks)")
        ax.axhline(4.1589, color="gray", ls=":", lw=1, label="uniform guess, ln 64")
        ax.axhline(chain_entropy(args.seed), color="green", ls="--", lw=1, label="the data's entropy (floor)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_title(plot_title(args, world_size), fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        os.makedirs(args.out, exist_ok=True)
        fig.savefig(plot_path(args))
        print(f"loss curve written to {plot_path(args)}")


if __name__ == "__main__":
    if torch.cuda.is_available():  # under torchrun: one process per GPU
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)  # multicast off (README, "Install on a GPU machine")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        main(dist.group.WORLD)
        dist.destroy_process_group()
    elif "LOCAL_RANK" in os.environ:  # torchrun without a GPU: a gloo group; the EP groups use the nccl backend
        dist.init_process_group("gloo")
        main(dist.group.WORLD)
        dist.destroy_process_group()
    else:  # no GPU: forked CPU ranks, gloo; the EP subgroups use the nccl (torch.distributed) backend
        import sys

        import torch._dynamo  # noqa: F401  (imported once before the ranks fork: the optimizer imports it lazily)
        import torch.distributed.checkpoint  # noqa: F401

        from tritonep.testing import run_cpu_world

        parse_args(sys.argv[1:])  # --help and bad flags answered once, here, not by every forked rank
        run_cpu_world(4, main, sys.argv[1:], timeout_s=3600)

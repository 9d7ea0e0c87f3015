"""The nccl (torch.distributed) backend: its kernels, host plan, wires and per-call host budget."""

"""@triton.jit bodies of the nccl backend's local steps (route, unpack, reduce, plan, one-hop)."""

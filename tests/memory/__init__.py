"""Symmetric memory: region layout, the CPU heap (allocation, reuse, peer views), peer-writing kernels."""

"""Shared @triton.jit primitives: signals and bounded waits, the protocol's names, small device functions."""

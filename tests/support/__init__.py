"""Test-only support: the harness, the GPU checks, offline compile checks, probe kernels."""

"""The triton backend's own parts: counts exchange, decode and fused paths, launch plumbing, staging, wires."""

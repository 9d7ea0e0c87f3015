"""@triton.jit bodies of the virtual-expert planner."""

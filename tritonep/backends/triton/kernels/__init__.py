"""@triton.jit bodies of the triton backend (dispatch, combine, decode, fused, layout, expert transport)."""

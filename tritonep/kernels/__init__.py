"""@triton.jit kernel bodies, one file per family (signal, layout, dispatch, combine, quant, planner)."""

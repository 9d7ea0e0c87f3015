"""@triton.jit bodies of the wire formats (quantizers, device codecs)."""

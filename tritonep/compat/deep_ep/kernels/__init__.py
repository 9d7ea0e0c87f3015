"""The compat Buffer's own Triton kernels (local, no peer access): DeepEP's dispatch layout, the packing of a
dispatch's lane inputs and the unpacking of the meta lane's rows. Their torch twins are
:func:`tritonep.compat.deep_ep.packing.layout_torch`, :func:`tritonep.compat.deep_ep.packing.pack_torch` and
:func:`tritonep.compat.deep_ep.packing.unpack_meta`."""

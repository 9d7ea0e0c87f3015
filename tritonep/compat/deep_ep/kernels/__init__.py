"""The compat Buffer's own Triton kernels (local, no peer access): DeepEP's dispatch layout, the packing of a
dispatch's lane inputs and the unpacking of the meta lane's rows (:mod:`.meta`), and the NaN fill of a
``num_worst_tokens`` call refused for capacity (:mod:`.poison`); their host side is
:class:`tritonep.compat.deep_ep.meta.MetaOps`. Their torch twins are :func:`tritonep.compat.deep_ep.packing.layout_torch`,
:func:`tritonep.compat.deep_ep.packing.pack_torch`, :func:`tritonep.compat.deep_ep.packing.unpack_meta` and
:func:`tritonep.compat.deep_ep.packing.poison_torch`."""

"""The compat Buffer's own Triton kernels (local, no peer access): DeepEP's dispatch layout, the packing of a
dispatch's lane inputs and the unpacking of the meta lane's rows (:mod:`.meta`), the packing and unpacking of a
dispatch whose top-k travels as meta rows of the rows lane (:mod:`.meta_rows`), and the NaN fill of a
``num_worst_tokens`` call refused for capacity (:mod:`.poison`); their host side is
:class:`tritonep.compat.deep_ep.meta.MetaOps`. Their torch twins are :func:`tritonep.compat.deep_ep.packing.layout_torch`,
:func:`tritonep.compat.deep_ep.packing.pack_torch`, :func:`tritonep.compat.deep_ep.packing.unpack_meta`,
:func:`tritonep.compat.deep_ep.packing.pack_rows_torch`, :func:`tritonep.compat.deep_ep.packing.unpack_rows_torch` and
:func:`tritonep.compat.deep_ep.packing.poison_torch`."""

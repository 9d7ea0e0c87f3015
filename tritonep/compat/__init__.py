"""Drop-in replacements of other expert-parallel libraries' Python APIs, built on :class:`tritonep.EPBuffer` (top of
the import order, beside :mod:`tritonep.integrations`: they import tritonep, never the other way round).

* :mod:`tritonep.compat.deep_ep`: DeepEP's V1 ``deep_ep.Buffer`` API (normal and low-latency modes), so that code
  written for DeepEP (Megatron-LM's flex dispatcher, vLLM's and SGLang's DeepEP paths) runs on tritonep after
  ``tritonep.compat.deep_ep.install()`` (docs/deep_ep.md).
"""

__all__: list[str] = []

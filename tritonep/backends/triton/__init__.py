"""The triton backend: symmetric memory + Triton kernels, for groups whose ranks map each other's memory.

:mod:`.backend` (:class:`TritonEP`, one rank's dispatch / combine), :mod:`.regions` (its symmetric regions, also
``required_bytes``), :mod:`.outputs` and :mod:`.decode` (the dispatch outputs, the one-launch decode path),
:mod:`.calls` (every launch, bound once through :mod:`tritonep.runtime.launch`), and the virtual-expert data
movement services: :mod:`.counts` (counts exchange) and :mod:`.expert_transport` (weights into peers' slots, gradients back).
EPBuffer reaches it only through the registry (:mod:`tritonep.backends`).
"""

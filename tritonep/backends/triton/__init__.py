"""The triton backend: symmetric memory + Triton kernels, for groups whose ranks map each other's memory.

:mod:`.backend` (:class:`TritonEP`, one rank's dispatch / combine: one class composed of parts), :mod:`.status`
(:class:`CallStatus`: status word, host read, verdicts, errors), :mod:`.outputs` (:class:`HandleLayout`,
:class:`DispatchOutputs`), :mod:`.calls` (:class:`KernelSet`: every launch, bound once through
:mod:`tritonep.runtime.launch`), :mod:`.decode` (:class:`DecodePath`: the one-launch decode path), :mod:`.tiles`
(:class:`KernelTiles`: the tile table), :mod:`.regions` (its symmetric regions, also ``required_bytes``),
:mod:`.handle` (:class:`TritonHandle`), :mod:`.kernels` (the @triton.jit bodies), and the virtual-expert services:
:mod:`.counts` (counts exchange) and :mod:`.expert_transport` (weights into peers' slots, gradients back). EPBuffer
reaches it only through the registry and the backend interface (:mod:`tritonep.backends`).
"""
